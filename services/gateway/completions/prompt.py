"""From a ``/v1/completions`` request to one tokenized prompt per choice, with its length checks.

There is no chat template here: the caller writes the whole prompt. A string prompt is encoded
with ``tokenizer.encode``, so control-token text in it (``<|im_start|>``, ``<|im_end|>``, ...)
*is* the control token, as vLLM's completions endpoint does; that is how a client writes its own
template. (Chat is different: user text there is only ever text.) Token-id prompts go to the
model as they are, once every id is known to be in the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


from crescent.services.gateway.completions.api import CompletionRequest
from crescent.services.gateway.errors import InvalidRequestError
from crescent.services.gateway.prompt import ServedModel, fit_completion


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    token_ids: tuple[int, ...]
    text: str          # what ``echo`` puts before the completion
    max_tokens: int


def _check_vocabulary(ids: Sequence[int], vocab_size: int, which: str) -> None:
    unknown = next((i for i in ids if i >= vocab_size), None)
    if unknown is not None:
        raise InvalidRequestError(
            f"{which} holds token id {unknown}, outside this model's vocabulary (ids 0 to {vocab_size - 1})",
            param="prompt", code="invalid_value",
        )


def _fit(token_ids: tuple[int, ...], request: CompletionRequest, window: int, which: str) -> int:
    """The prompt's max_tokens: the requested one if it fits, else a 400; the default shrinks to fit."""
    requested = request.max_tokens if request.max_tokens_given() else None
    return fit_completion(len(token_ids), window, requested, request.max_tokens,
                          subject=f"{which} takes", prompt_param="prompt", max_param="max_tokens")


def build_completion_prompts(request: CompletionRequest, model: ServedModel) -> list[CompletionPrompt]:
    """Tokenize (or check) every prompt of the request; index i is choice i."""
    tokenizer = model.tokenizer
    prompts = request.prompts()
    prompts_out = []
    for index, prompt in enumerate(prompts):
        which = "the prompt" if len(prompts) == 1 else f"prompt[{index}]"
        if isinstance(prompt, str):
            token_ids = tuple(tokenizer.encode(prompt))
            text = prompt
            if not token_ids:
                raise InvalidRequestError(f"{which} encodes to no tokens", param="prompt", code="invalid_value")
        else:
            _check_vocabulary(prompt, tokenizer.vocab_size, which)
            token_ids = tuple(prompt)
            text = tokenizer.decode(token_ids) if request.echo else ""
        prompts_out.append(CompletionPrompt(token_ids, text, _fit(token_ids, request, model.context_window, which)))
    return prompts_out

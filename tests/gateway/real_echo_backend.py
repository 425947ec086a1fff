"""The fake backend reading prompts and writing replies with the default model's real tokenizer.

``fake_backend`` decodes a prompt and encodes its echo with the fake tokenizer; a gateway that
serves SmolLM2 (the production entry) sends real token ids, so this is the same backend speaking
SmolLM2's vocabulary instead (``vocab``, a ``fake_backend.Vocab``): a test still scripts the reply
by sending it as the last user message, and the gateway detokenizes it as it would a real model's
tokens. In the test process: ``InProcessBackend(vocab=vocab())``.

Run as a process: ``python -m tests.gateway.real_echo_backend --port P --control-port C --block-size B``.
"""

from __future__ import annotations

import re

from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
from crescent.services.model.tokenizer import Tokenizer

from tests.gateway import fake_backend


def vocab(tokenizer: Tokenizer | None = None) -> fake_backend.Vocab:
    """SmolLM2's ChatML as the fake backend reads and writes it (``tokenizer``: SmolLM2's, loaded if None)."""
    tokenizer = tokenizer or Tokenizer.for_model(resolve_model(DEFAULT_MODEL))
    return fake_backend.Vocab(
        tokenizer, chat_start=tokenizer.token_to_id("<|im_start|>"),
        reply_end=tokenizer.token_to_id("<|im_end|>"),  # SmolLM2's end of turn: the gateway stops there
        last_user=re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S))


def main() -> None:
    fake_backend.main(vocab)


if __name__ == "__main__":
    main()

"""One generation (of a request, or of one of its choices) as the client sees it: text deltas,
then a finish with usage.

The gateway owns detokenization, so stop strings are applied here: when the generated text
contains one, the text before it is the last delta, the finish reason is "stop", and the
backend stream is closed, which cancels the request in decode.

A request that asked for logprobs also gets ``TokenLogprobs`` events, each just before the
text its tokens produced (``logprobs`` says which tokens get one).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal

from crescent.services.gateway.accounting import RequestRecord, UsageCounts
from crescent.services.gateway.backend import BackendEvent, FinishReason, FirstToken, GenerationRequest
from crescent.services.gateway.errors import InternalError
from crescent.services.gateway.logprobs import LogprobTracker, TokenLogprobs
from crescent.services.gateway.owning import Owning
from crescent.services.gateway.prompt import ChatTokenizer
from crescent.services.gateway.stop_strings import StopStringMatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: FinishReason | Literal["tool_calls"]  # "tool_calls": set by assistant_output
    usage: UsageCounts


GenerationEvent = TextDelta | TokenLogprobs | Finished


def generate_text(
    events: AsyncGenerator[BackendEvent, None],
    tokenizer: ChatTokenizer,
    request: GenerationRequest,
    stop_strings: Sequence[str],
    record: RequestRecord,
    choice: int = 0,
) -> AsyncGenerator[GenerationEvent, None]:
    """Read ``events`` (the backend's for ``request``, or for one of its choices) and yield
    non-empty ``TextDelta``s (and ``TokenLogprobs`` when asked), then exactly one ``Finished``
    (with this generation's usage); ``choice``: which of the request's choices this is, for
    ``record``. Closing it closes ``events``, read or not."""
    return Owning(_generate_text(events, tokenizer, request, stop_strings, record, choice), events.aclose)


async def _generate_text(
    events: AsyncGenerator[BackendEvent, None],
    tokenizer: ChatTokenizer,
    request: GenerationRequest,
    stop_strings: Sequence[str],
    record: RequestRecord,
    choice: int,
) -> AsyncGenerator[GenerationEvent, None]:
    detokenizer = tokenizer.new_detokenizer()
    tracker = None
    if request.sampling.logprobs is not None:
        tracker = LogprobTracker(tokenizer.token_bytes)
    matcher = StopStringMatcher(stop_strings)
    eos = frozenset(tokenizer.eos_token_ids)
    prompt_tokens = len(request.prompt_token_ids)
    cached_tokens = 0
    completion_tokens = 0

    def usage() -> UsageCounts:
        # The record adds the choice's reasoning tokens, which its output parser tells it.
        return record.set_usage(UsageCounts(prompt_tokens, cached_tokens, completion_tokens), choice)

    async with aclosing(events):
        async for event in events:
            if isinstance(event, FirstToken):
                prompt_tokens = event.prompt_tokens or prompt_tokens
                cached_tokens = event.cached_tokens
                token_ids: Sequence[int] = (event.token_id,)
                logprobs = (event.logprob,) if event.logprob is not None else ()
            else:
                token_ids, logprobs = event.token_ids, event.logprobs
            if tracker is not None and len(logprobs) != len(token_ids):
                raise InternalError(f"the backend sent {len(logprobs)} log-probabilities for {len(token_ids)} tokens")
            record.tokens_arrived(len(token_ids), choice)
            for i, token_id in enumerate(token_ids):
                completion_tokens += 1
                usage()  # a request cut short still reports what it used
                if token_id in eos:
                    continue  # the end-of-turn token is not part of the answer's text
                text = detokenizer.push(token_id)
                scan = matcher.push(text)
                if tracker is not None:
                    tracker.generated(logprobs[i], text)
                    if (ready := tracker.released(scan.text)) is not None:
                        yield ready
                if scan.text:
                    yield TextDelta(scan.text)
                if scan.stopped:
                    await events.aclose()  # cancels the decode stream: decode frees the request now
                    yield Finished("stop", usage())
                    return
            if event.finish_reason is not None:
                tail = matcher.flush()
                if tracker is not None and (ready := tracker.flush()) is not None:
                    yield ready
                if tail:
                    yield TextDelta(tail)
                yield Finished(event.finish_reason, usage())
                return
    raise InternalError("the backend ended the request without a finish reason")

"""Server-sent events for streamed text completions, one or several choices in one stream.

The stream is ``data: {text_completion}\\n\\n`` lines, each carrying one choice's new ``text``
(with ``echo``, a choice's first chunk is its prompt); a choice ends with a chunk holding its
``finish_reason``. Choices are generated concurrently, so their chunks interleave, each tagged
with its ``index``; with ``logprobs``, a chunk carries the entries of the tokens whose text it
holds. After the last choice ends come a usage chunk (``choices: []``, usage summed
over the choices) when ``stream_options.include_usage`` is set, then ``data: [DONE]``.

A stream that cannot finish (a choice failed past what migration could save, or the drain
grace ran out) ends, as chat's does (``sse``), with one chunk that gives every choice still open
``finish_reason: "error"`` and carries the ``"error"`` object, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from crescent.services.gateway.accounting import RequestRecord, UsageCounts
from crescent.services.gateway.api_models import Usage
from crescent.services.gateway.completions_api import (
    CompletionChunkChoice,
    CompletionStreamFinishReason,
    TextCompletionChunk,
)
from crescent.services.gateway.drain import Drain
from crescent.services.gateway.errors import ApiError, InternalError
from crescent.services.gateway.generation import Finished, GenerationEvent, TextDelta
from crescent.services.gateway.logprobs import ReportedToken, TokenLogprobs, completion_logprobs
from crescent.services.gateway.sse import DONE, ChunkHeader, status_of, usage_model

log = logging.getLogger(__name__)

Events = AsyncGenerator[GenerationEvent, None]


def total_usage(usages: Sequence[UsageCounts]) -> UsageCounts:
    """One request's usage over its choices: every prompt and every completion counts."""
    return UsageCounts(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
    )


class CompletionStream:
    """One streamed response: each choice's pending generation and its record; index i is choice i."""

    def __init__(self, header: ChunkHeader, echoes: Sequence[str], events: Sequence[Events],
                 firsts: Sequence[GenerationEvent], records: Sequence[RequestRecord], drain: Drain) -> None:
        assert len(echoes) == len(events) == len(firsts) == len(records)
        self._header = header
        self._echoes = echoes
        self._events = events
        self._firsts = firsts
        self._records = records
        self._drain = drain
        self._usage: dict[int, UsageCounts] = {}
        self._reading: dict[asyncio.Task[GenerationEvent], int] = {}  # each open choice's next event
        self._logprobs: dict[int, list[ReportedToken]] = {}  # by choice: entries for its next chunk

    def _chunk(self, choices: list[CompletionChunkChoice], usage: Usage | None = None,
               error: ApiError | None = None) -> str:
        h = self._header
        chunk = TextCompletionChunk(id=h.request_id, created=h.created, model=h.model, choices=choices, usage=usage)
        body = chunk.model_dump(exclude=None if h.include_usage else {"usage"})
        if error is not None:
            body.update(error.body())
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _text(self, index: int, text: str, finish_reason: CompletionStreamFinishReason | None = None) -> str:
        entries = self._logprobs.pop(index, None)  # waiting for this choice's next chunk
        logprobs = completion_logprobs(entries) if entries else None
        return self._chunk([CompletionChunkChoice(index=index, text=text, finish_reason=finish_reason,
                                                  logprobs=logprobs)])

    def _open(self) -> list[int]:
        return sorted(i for i in range(len(self._events)) if i not in self._usage)

    def _on(self, index: int, event: GenerationEvent) -> str | None:
        """The chunk for one event (None: it waits for the next one); after a ``Finished`` the
        choice is closed, else its next read starts."""
        if isinstance(event, Finished):
            self._usage[index] = event.usage
            self._records[index].finish("ok")
            return self._text(index, "", event.finish_reason)  # type: ignore[arg-type]  # no tools here
        self._reading[asyncio.ensure_future(anext(self._events[index]))] = index
        if isinstance(event, TokenLogprobs):  # they come before their text: its chunk carries them
            self._logprobs.setdefault(index, []).extend(event.entries)
            return None
        assert isinstance(event, TextDelta)
        return self._text(index, event.text)

    async def _next_events(self) -> list[tuple[int, GenerationEvent]]:
        """The events ready next, by choice; raises the first failure of any choice."""
        done, _ = await asyncio.wait(self._reading, return_when=asyncio.FIRST_COMPLETED)
        ready = sorted((self._reading.pop(task), task) for task in done)
        return [(index, task.result()) for index, task in ready]

    async def sse(self) -> AsyncIterator[str]:
        for index, echo in enumerate(self._echoes):
            if echo:
                yield self._text(index, echo)
        ready = list(enumerate(self._firsts))
        while True:
            for index, event in ready:
                if (chunk := self._on(index, event)) is not None:
                    yield chunk
            if not self._reading:
                break
            try:
                ready = await self._drain.race(self._next_events())
            except ApiError as exc:
                error: ApiError = exc
            except StopAsyncIteration:
                error = InternalError("the generation ended without a finish")
            except Exception:
                log.exception("stream failed")
                error = InternalError("internal error")
            else:
                continue
            yield self._error(error)
            yield DONE
            return
        if self._header.include_usage:
            yield self._chunk([], usage=usage_model(total_usage([self._usage[i] for i in sorted(self._usage)])))
        yield DONE

    def _error(self, error: ApiError) -> str:
        log.warning("stream failed after it started: %s", error.message)
        open_choices = self._open()
        for index in open_choices:
            self._records[index].finish(status_of(error))  # type: ignore[arg-type]  # a RequestStatus
        choices = [CompletionChunkChoice(index=i, text="", finish_reason="error") for i in open_choices]
        return self._chunk(choices, error=error)

    async def close(self) -> None:
        """Cancel whatever is still running; a choice that did not finish counts as cancelled."""
        for task in self._reading:
            task.cancel()  # the response ended (client gone, error) while reads were in flight
        await asyncio.gather(*self._reading, return_exceptions=True)
        self._reading.clear()
        for events in self._events:
            await events.aclose()
        for record in self._records:
            record.finish("cancelled")

"""Server-sent events for streamed text completions: ``choice_stream``'s chunks in this endpoint's shape.

The stream is ``data: {text_completion}\\n\\n`` lines, each carrying one choice's new ``text``
(with ``echo``, a choice's first chunk is its prompt); a choice ends with a chunk holding its
``finish_reason``. Choices (every prompt's ``n``, index = prompt index * n + i) are generated
concurrently, so their chunks interleave, each tagged with its ``index``; with ``logprobs``, a
chunk carries the entries of the tokens whose text it holds. After the last choice ends come a
usage chunk (``choices: []``, ``completions.response_usage``) when
``stream_options.include_usage`` is set, then ``data: [DONE]``. A stream that cannot finish ends,
as chat's does, with one chunk that gives every choice still open ``finish_reason: "error"`` and
carries the ``"error"`` object, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from crescent.services.gateway.accounting import UsageCounts
from crescent.services.gateway.api_models import Usage
from crescent.services.gateway.completions.api import (
    CompletionChunkChoice,
    CompletionStreamFinishReason,
    TextCompletionChunk,
)
from crescent.services.gateway.errors import ApiError
from crescent.services.gateway.generation import Finished, GenerationEvent, TextDelta
from crescent.services.gateway.logprobs import ReportedToken, TokenLogprobs, completion_logprobs
from crescent.services.gateway.sse import ChunkHeader, usage_model


class CompletionChunks:
    """Text completions' ``choice_stream.ChunkFormat``; ``echoes[i]``: what choice i's text starts with."""

    def __init__(self, header: ChunkHeader, echoes: Sequence[str]) -> None:
        self._header = header
        self._echoes = echoes
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

    def opening(self, index: int) -> str | None:
        return self._text(index, self._echoes[index]) if self._echoes[index] else None

    def event(self, index: int, event: GenerationEvent) -> str | None:
        if isinstance(event, TokenLogprobs):  # they come before their text: its chunk carries them
            self._logprobs.setdefault(index, []).extend(event.entries)
            return None
        assert isinstance(event, TextDelta), event
        return self._text(index, event.text)

    def finished(self, index: int, event: Finished) -> str:
        return self._text(index, "", event.finish_reason)  # type: ignore[arg-type]  # no tools here

    def failed(self, open_choices: list[int], error: ApiError) -> str:
        for index in open_choices:
            self._logprobs.pop(index, None)  # their text never came
        return self._chunk([CompletionChunkChoice(index=i, text="", finish_reason="error") for i in open_choices],
                           error=error)

    def usage(self, usage: UsageCounts) -> str | None:
        return self._chunk([], usage=usage_model(usage)) if self._header.include_usage else None

"""One streamed response of one or several choices: chat's (``sse``) and text completions'.

Choices are generated concurrently, so their chunks interleave, each tagged with its ``index``;
what a chunk looks like is the endpoint's ``ChunkFormat``. Every choice opens (chat's role
delta, completions' echo), streams its events, and ends with a chunk holding its finish reason.
After the last one come a usage chunk when ``stream_options.include_usage`` is set, then
``data: [DONE]``.

The stream starts once each prompt's leader (``choices``) has its first event; the other choices
start reading when the stream does. A stream that cannot finish (a choice failed past what
migration could save, or the drain grace ran out) ends with one chunk that gives every choice
still open ``finish_reason: "error"`` and carries the ``"error"`` object (the ``openai`` client
raises it), then ``data: [DONE]``: a client always sees a finish reason for every choice and
``[DONE]``. However the response ends (finished, client gone, server stopping), ``close``
cancels every choice's generation, which aborts its backend request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from crescent.services.gateway.accounting import RequestRecord, RequestStatus, UsageCounts
from crescent.services.gateway.drain import Drain
from crescent.services.gateway.errors import ApiError, InternalError, RateLimitedError
from crescent.services.gateway.generation import Finished

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"

Event = TypeVar("Event")
Event_contra = TypeVar("Event_contra", contravariant=True)


T = TypeVar("T")


async def result_or_error(work: Awaitable[T]) -> T | ApiError:
    """``work``'s result, or the error a client should see when it failed after the stream began
    (a generation that ended without a finish included)."""
    try:
        return await work
    except ApiError as exc:
        return exc
    except StopAsyncIteration:
        return InternalError("the generation ended without a finish")
    except Exception:  # noqa: BLE001 - a bug: logged here, the client gets an error event
        log.exception("stream failed")
        return InternalError("internal error")


def status_of(error: ApiError) -> RequestStatus:
    """The requests-counter label for an error."""
    if isinstance(error, RateLimitedError):
        return "rejected"  # told to retry later: the scheduler's early rejection, or no capacity
    return "client_error" if 400 <= error.status < 500 else "error"


class ChunkFormat(Protocol[Event_contra]):
    """How one endpoint writes its ``data:`` lines; it keeps what a choice holds back (logprobs)."""

    def opening(self, index: int) -> str | None:
        """The chunk that opens a choice (None: none)."""
        ...

    def event(self, index: int, event: Event_contra) -> str | None:
        """The chunk for an event that is not a ``Finished`` (None: it rides with a later chunk)."""
        ...

    def finished(self, index: int, event: Finished) -> str: ...

    def failed(self, open_choices: list[int], error: ApiError) -> str:
        """The one chunk that ends every choice still open with ``error``."""
        ...

    def usage(self, usage: UsageCounts) -> str | None:
        """The usage chunk (None: the client did not ask for one)."""
        ...


class ChoiceStream(Generic[Event]):
    """Each choice's pending generation (index i is choice i), the leaders' first events, and
    the record each choice reports to (choices of one prompt share one)."""

    def __init__(self, fmt: ChunkFormat[Event], events: Sequence[AsyncGenerator[Event, None]],
                 firsts: Mapping[int, Event], records: Sequence[RequestRecord],
                 total: Callable[[list[UsageCounts]], UsageCounts], drain: Drain) -> None:
        assert len(events) == len(records) and all(0 <= i < len(events) for i in firsts)
        self._fmt = fmt
        self._events = events
        self._firsts = firsts
        self._records = records
        self._total = total  # the response's usage from its choices' (in choice order)
        self._drain = drain
        self._usage: dict[int, UsageCounts] = {}  # of the choices that finished
        self._reading: dict[asyncio.Task[Event], int] = {}  # each open choice's next event

    def _read(self, index: int) -> None:
        self._reading[asyncio.ensure_future(anext(self._events[index]))] = index

    def _open(self) -> list[int]:
        return [i for i in range(len(self._events)) if i not in self._usage]

    def _on(self, index: int, event: Event) -> str | None:
        """The chunk for one event; after a ``Finished`` the choice is closed, else its next read starts."""
        if isinstance(event, Finished):
            self._usage[index] = event.usage
            record = self._records[index]
            if all(j in self._usage for j, r in enumerate(self._records) if r is record):
                record.finish("ok")  # its last choice ended
            return self._fmt.finished(index, event)
        self._read(index)
        return self._fmt.event(index, event)

    async def _next_events(self) -> list[tuple[int, Event]]:
        """The events ready next, by choice; raises the first failure of any choice."""
        done, _ = await asyncio.wait(self._reading, return_when=asyncio.FIRST_COMPLETED)
        ready = sorted(((self._reading.pop(task), task) for task in done), key=lambda pair: pair[0])
        return [(index, task.result()) for index, task in ready]

    async def sse(self) -> AsyncIterator[str]:
        for index in range(len(self._events)):
            if (opening := self._fmt.opening(index)) is not None:
                yield opening
        for index in range(len(self._events)):
            if index not in self._firsts:
                self._read(index)  # a choice that waited for its prompt's leader starts now
        ready = sorted(self._firsts.items(), key=lambda pair: pair[0])
        while True:
            for index, event in ready:
                if (chunk := self._on(index, event)) is not None:
                    yield chunk
            if not self._reading:
                break
            ready = await result_or_error(self._drain.race(self._next_events()))
            if not isinstance(ready, ApiError):
                continue
            yield self._error(ready)
            yield DONE
            return
        for record in dict.fromkeys(self._records):  # choices of one prompt share their record
            await record.committed()  # a client that has the whole stream is in the usage ledger
        if (usage := self._fmt.usage(self._total([self._usage[i] for i in sorted(self._usage)]))) is not None:
            yield usage
        yield DONE

    def _error(self, error: ApiError) -> str:
        log.warning("stream failed after it started: %s", error.message)
        open_choices = self._open()
        for index in open_choices:
            self._records[index].finish(status_of(error))  # a no-op for a record already finished
        return self._fmt.failed(open_choices, error)

    async def close(self) -> None:
        """Cancel whatever is still running; a choice that did not finish counts as cancelled."""
        for task in self._reading:
            task.cancel()  # the response ended (client gone, error) while reads were in flight
        await asyncio.gather(*self._reading, return_exceptions=True)
        self._reading.clear()
        for events in self._events:
            await events.aclose()
        for record in self._records:
            record.finish("cancelled")  # a no-op for the records already finished

"""What a decode instance does with one request, without gRPC: land -> check -> admit -> stream
-> end (``DecodeServicer`` converts the messages around it).

- **land**: read a Handoff stream to its end (``handoff_in.py``: whole blocks, layer-wise bytes,
  shared memory or the TCP side channel); refusals the header alone decides (draining, aborted
  before it came, already here, larger than the whole cache) come before any KV is read;
- **check**: what makes the landed request unusable here (``HandoffIntake.problem``), each
  choice's structured-output constraint continued where prefill left it;
- **admit**: a ``DecodeRequest`` handed to the ``Batcher``, which waits for its pages and
  batches its choices' steps (an aggregated instance's in-process handoff enters here too,
  its KV a local sequence instead of payloads);
- **stream**: the request's updates, a reader that fell behind catching up in one update per
  choice; a request that did not finish normally ends with its ending (``request.ENDINGS``);
- **end**: a stream read to its end forgets the request; one whose reader went away aborts it
  (its slot and KV go back at once). An ``Abort`` for a request not here yet leaves a
  tombstone that refuses its handoff for a while.

Every refusal is a ``Refused`` carrying a ``Refusal``; the servicer maps each to a status code.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import replace
from typing import Any, TypeVar

import torch

from crescent.protos import common_pb2, decode_pb2
from crescent.services.common.logs import request_id_var
from crescent.services.contract.choices import choice_seed, reserve_tokens
from crescent.services.contract.finish import stop_token_ids
from crescent.services.decode.batcher import Batcher
from crescent.services.decode.handoff_in import HandoffIntake, HandoffRefused, first_tokens, open_choices
from crescent.services.decode.handoff_side import HandoffSideChannel, HandoffTooLarge
from crescent.services.decode.request import ENDINGS, Choice, DecodeRequest, TokenUpdate
from crescent.services.engine.constraints import (ConstraintError, Constraints, TokenConstraint,
                                                  compile_constraint)
from crescent.services.engine.engine import Sequence
from crescent.services.instance.wire import sampling_config
from crescent.services.kvwire.handoff_tcp import TCP_REFUSAL
from crescent.services.kvwire.handoff_wire import HandoffWirePart
from crescent.services.kvwire.kv_block import BlockFormatError

DRAINING_MESSAGE = "draining: this decode instance takes no new requests"
U = TypeVar("U", bound=Any)  # a token update (see coalesced)
TOMBSTONE_TTL_S = 60.0  # an Abort that came before its Handoff refuses that Handoff this long


class Refusal(enum.Enum):
    """Why decode does not take (or stream) a request; the servicer's status code for each."""

    DRAINING = "draining"          # UNAVAILABLE: the gateway places it elsewhere
    ABORTED = "aborted"            # ABORTED: the gateway aborted it before it came
    ALREADY_HERE = "already_here"  # ALREADY_EXISTS: a second handoff, or a second reader
    NEVER_FITS = "never_fits"      # RESOURCE_EXHAUSTED: larger than the whole cache (or side channel)
    INVALID = "invalid"            # INVALID_ARGUMENT: malformed, or unusable here
    RESEND = "resend"              # FAILED_PRECONDITION: send it again as bytes (the mover's note first)
    NOT_FOUND = "not_found"        # NOT_FOUND: no such request to stream


class Refused(Exception):
    def __init__(self, reason: Refusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def never_fits_message(prompt_tokens: int, max_tokens: int, reserve: int, choices: int, capacity: int,
                       where: str = "this decode instance") -> str:
    """Why a request whose reservation exceeds the whole cache is refused (RESOURCE_EXHAUSTED)."""
    each = f" for each of {choices} choices" if choices > 1 else ""
    return (f"request needs {reserve} KV tokens (prompt {prompt_tokens} + max_tokens {max_tokens}){each}, "
            f"more than {where}'s whole cache of {capacity} tokens")


def coalesced(updates: list[U]) -> list[U]:
    """Consecutive updates of one choice in one update (a reader that fell behind catches up).
    An update with a ``detail`` (an error's words, a choice ended alone) is never merged. Any
    dataclass with ``index``, ``token_ids``, ``logprobs``, ``finish_reason`` and ``detail``: decode's
    ``TokenUpdate`` and the vLLM backend's ``ChoiceUpdate``."""
    out: list[U] = []
    for update in updates:
        prev = out[-1] if out else None
        if (prev is not None and prev.finish_reason is None and prev.index == update.index and not prev.detail
                and update.finish_reason not in ENDINGS and not update.detail):
            out[-1] = replace(update, token_ids=prev.token_ids + update.token_ids,
                              logprobs=prev.logprobs + update.logprobs)
        else:
            out.append(update)
    return out


def _max_tokens(header: decode_pb2.HandoffHeader) -> int:
    """Tokens to generate, prefill's first one included."""
    return max(header.sampling.max_tokens, 1)


class Tombstones:
    """Ids of requests aborted before they arrived, each remembered for ``ttl_s``."""

    def __init__(self, ttl_s: float = TOMBSTONE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._until: dict[str, float] = {}

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._until = {k: t for k, t in self._until.items() if t > now}  # forget the old ones
        self._until[request_id] = now + self.ttl_s

    def __contains__(self, request_id: str) -> bool:
        return self._until.get(request_id, 0.0) > time.monotonic()


class DecodePipeline:
    """One decode instance's request path over its ``Batcher`` (one per servicer)."""

    def __init__(self, batcher: Batcher, constraints: Constraints | None = None, shm_handoff: bool = True,
                 side: HandoffSideChannel | None = None) -> None:
        """``shm_handoff``: map a layer-wise handoff's shared memory segment (off: refuse it);
        ``side``: the handoff side channel (TCP) ``open_handoff`` opens handoffs on (None: refuse)."""
        self.batcher = batcher
        self.engine = batcher.engine
        self.constraints = constraints
        self.side = side
        self.intake = HandoffIntake(self.engine, shm_handoff, side)
        self.tombstones = Tombstones()

    # ---- a handoff: land, check, admit ---------------------------------------------------------

    async def handoff(self, parts: AsyncIterable[HandoffWirePart]) -> DecodeRequest:
        """Land one Handoff stream and admit its request; ``Refused`` for what is not taken."""
        if self.batcher.draining:
            raise Refused(Refusal.DRAINING, DRAINING_MESSAGE)
        start = time.perf_counter()

        async def on_header(header: decode_pb2.HandoffHeader) -> None:
            request_id_var.set(header.request_id)
            self._refuse_early(header)

        try:  # the four landing modes: handoff_in.py
            landed = await self.intake.land(parts, on_header)
        except BlockFormatError as exc:
            raise Refused(Refusal.INVALID, f"malformed handoff: {exc}") from exc
        except HandoffRefused as exc:
            raise Refused(Refusal.RESEND, str(exc)) from exc
        header, payloads = landed.header, landed.payloads
        if header is None:
            raise Refused(Refusal.INVALID, "empty handoff")
        problem = self.intake.problem(header, payloads)
        if problem:
            raise Refused(Refusal.INVALID, problem)
        request = await self.accept(header, payloads)
        metrics = self.batcher.metrics
        metrics.transfer_bytes.labels("decode", "handoff_in").inc(landed.received)
        metrics.transfer_seconds.labels("decode", "handoff_in").observe(time.perf_counter() - start)
        return request

    async def accept(self, header: decode_pb2.HandoffHeader, payloads: list[torch.Tensor] | None,
                     local_prompt: Sequence | None = None) -> DecodeRequest:
        """Hand a checked request to the batcher: its KV in ``payloads`` (a handoff), or in
        ``local_prompt``, a sequence this process prefilled (an aggregated instance)."""
        first_step = max(header.sampling.first_step, 0)
        stops = stop_token_ids(header.sampling.stop_token_ids, self.engine.config.eos_token_ids,
                               header.sampling.ignore_eos)
        sampling = sampling_config(header.sampling, stops)
        choices = []
        for index, first in enumerate(first_tokens(header)):
            if index in header.finished_choices:
                continue
            token_ids = [*header.prompt_token_ids, first]
            # The constraint continues where prefill left it: it takes every token generated so far.
            generated = token_ids[len(token_ids) - first_step - 1:]
            constraint = await self._constraint(header.sampling, generated)
            choices.append(Choice(index, token_ids, replace(sampling, seed=choice_seed(sampling.seed, index)),
                                  constraint))
        if local_prompt is None:
            self._refuse_early(header)  # again: the stream took a while
        # A local prompt was accepted here before any drain began: it is finished, not refused.
        elif header.request_id in self.tombstones:  # the gateway aborted it while it was prefilled here
            raise Refused(Refusal.ABORTED, f"request {header.request_id} was aborted")
        request = DecodeRequest(
            request_id=header.request_id, choices=choices, payloads=payloads, max_tokens=_max_tokens(header),
            stop_token_ids=stops, reserve_tokens=self._reserve_tokens(header), first_step=first_step,
            local_prompt=local_prompt,
        )
        self.batcher.accept(request)
        return request

    async def _constraint(self, sampling: common_pb2.SamplingParams,
                          generated: list[int]) -> TokenConstraint | None:
        """The request's structured-output matcher (None: unconstrained)."""
        try:
            return await compile_constraint(self.constraints, sampling, generated)
        except ConstraintError as exc:
            raise Refused(Refusal.INVALID, f"constraint: {exc}") from exc

    def _reserve_tokens(self, header: decode_pb2.HandoffHeader) -> int:
        return reserve_tokens(len(header.prompt_token_ids), _max_tokens(header),
                              self.engine.config.max_position_embeddings)

    def _refuse_early(self, header: decode_pb2.HandoffHeader) -> None:
        """Refusals the header alone decides."""
        request_id = header.request_id
        if self.batcher.draining:
            raise Refused(Refusal.DRAINING, DRAINING_MESSAGE)
        if request_id in self.tombstones:
            raise Refused(Refusal.ABORTED, f"request {request_id} was aborted")
        if self.batcher.holds(request_id):
            raise Refused(Refusal.ALREADY_HERE, f"request {request_id} is already here")
        reserve = self._reserve_tokens(header)
        choices = open_choices(header)
        if self.batcher.never_fits(len(header.prompt_token_ids), reserve, choices):
            raise Refused(Refusal.NEVER_FITS, never_fits_message(
                len(header.prompt_token_ids), _max_tokens(header), reserve, choices,
                self.engine.cache.capacity_tokens))

    def open_handoff(self, request_id: str, total_bytes: int) -> tuple[str, bytes]:
        """Room for a layer-wise handoff's KV on the side channel (``handoff_side.py``):
        (the channel's address, the one-time token the handoff's header names)."""
        if self.side is None:
            raise Refused(Refusal.RESEND, f"{TCP_REFUSAL} no side channel on this decode instance")
        if self.batcher.draining:
            raise Refused(Refusal.DRAINING, DRAINING_MESSAGE)
        if not request_id:
            raise Refused(Refusal.INVALID, "request_id is empty")
        try:
            token = self.side.open(request_id, total_bytes)
        except HandoffTooLarge as exc:
            raise Refused(Refusal.NEVER_FITS, str(exc)) from exc
        except ValueError as exc:
            raise Refused(Refusal.INVALID, str(exc)) from exc
        return self.side.address, token

    # ---- streaming, ending ---------------------------------------------------------------------

    def stream(self, request_id: str) -> AsyncIterator[TokenUpdate]:
        """The request's updates until its last (or its ending, which the caller turns into an
        error and stops at); ``Refused`` now when there is no such request or it has a reader.
        Close the iterator (``contextlib.aclosing``): a reader that leaves early aborts the request."""
        entry = self.batcher.requests.get(request_id)
        if entry is None:
            raise Refused(Refusal.NOT_FOUND, f"no request {request_id} on this instance")
        if entry.claimed:
            raise Refused(Refusal.ALREADY_HERE, f"request {request_id} is already streaming")
        entry.claimed = True
        return self._updates(entry)

    async def _updates(self, entry: DecodeRequest) -> AsyncIterator[TokenUpdate]:
        done = False
        try:
            while not done:
                updates = [await entry.queue.get()]
                while not entry.queue.empty():
                    updates.append(entry.queue.get_nowait())
                for update in coalesced(updates):  # tokens before an ending go out first: none is lost
                    if update.finish_reason in ENDINGS:
                        done = True
                        yield update
                        return
                    yield update
                    if update.last:
                        done = True
                        break
        finally:
            if done:
                self.batcher.forget(entry.request_id)
            else:  # the reader went away (client disconnect): free the slot and KV now
                self.batcher.abort(entry.request_id, "stream cancelled")

    def abort(self, request_id: str, reason: str, one_choice: bool = False, index: int = 0) -> bool:
        """End a request (or one of its choices) at the caller's word; whether it was here. A
        whole request not here yet is refused when its handoff comes."""
        why = f"aborted by the caller: {reason or 'no reason given'}"
        if one_choice:
            return self.batcher.abort_choice(request_id, index, why)
        found = self.batcher.abort(request_id, why)
        if not found:
            self.tombstones.add(request_id)  # its handoff may still be on the way
        return found

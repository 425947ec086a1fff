"""A test-only process serving fake Scheduler, Prefill and Decode gRPC services, plus HTTP control.

The reply to a chat is the last user message echoed back (tokenized with the fake tokenizer),
then end-of-turn ("ok" for a chat with no user turn). A prompt that is not ChatML (no
``<|im_start|>``: a raw ``/v1/completions`` prompt) is echoed whole, as its text without control
tokens. Directives at the start of that message script the rest:
``#loop`` repeat the text forever (only max_tokens ends it), ``#delay=S`` seconds per decode
event, ``#batch=N`` tokens per event, ``#prefill_delay=S`` before the first token,
``#fail_after=N`` decode fails (UNAVAILABLE) after N events of every stream, ``#late_handoff=S`` a
cancelled prefill still hands the request to decode S seconds later (a handoff that was in
flight), ``#prefill_fail=N`` the first N prefills of this prompt fail (UNAVAILABLE) before their
first token, ``#handoff_fail=N`` the first N fail after their first token, before the handoff,
``#stuck_after=N`` every prefill of a request whose client has N tokens or more fails,
``#draw`` stands for sampling: a request with a seed gets the first ``1 + seed % W`` of the
message's W words (without a seed, all of them), so choices with different seeds differ.
Prefill honours ``first_step`` (a migrated request continues the reply where the client is).
With ``sampling.logprobs`` every token carries ``fake_logprob`` of its place in the reply, so a
migrated stream's entries continue where the client is too.
Like the real decode, StreamTokens for a request not handed off (yet) answers NOT_FOUND, and
``Abort`` drops a request (cancelling its stream) or leaves a tombstone that refuses its handoff.
``sampling.n`` > 1 works as in the real engines: prefill sends a first token per choice (choice
i scripted with seed ``choice_seed(seed, i)``) and hands off once; decode streams the choices'
events in rounds (one event per running choice, tagged by index: ``#delay`` and ``#fail_after``
count rounds), ends the stream when every choice has finished, and ``Abort`` with ``one_choice``
ends one choice alone.

Prefill reports cached tokens like a real prefix cache: full blocks whose salted chained keys
it has seen before. The control API (JSON over HTTP) arms scheduler rejections, sets how many
instances ListInstances reports (and their block size; Place refuses another one with
FAILED_PRECONDITION, as the real scheduler does), how long ReportOutcome takes, and shows what
each service received and observed.

The fake reads prompts and writes replies in a ``Vocab``: the fake tokenizer's by default; a
backend beside it may speak another (``real_echo_backend``: SmolLM2's, ``k3_echo_backend``: Kimi
K3's), each its own ``State``, so several run in one process (``in_process.py``).

Run: ``python -m tests.gateway.fake_backend --port P --control-port C --block-size B``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format
from crescent.protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from crescent.services.common.admin_http import AdminServer
from crescent.services.contract.block_keys import prefix_block_keys
from crescent.services.contract.choices import choice_seed
from fastapi import FastAPI

from .fake_tokenizer import IM_END, IM_START, MODEL_ID, FakeTokenizer

log = logging.getLogger("fake_backend")
_DIRECTIVE = re.compile(r"#(\w+)(?:=([\d.]+))?\s*")


@dataclass(frozen=True)
class Vocab:
    """How a fake backend reads a prompt and writes its reply."""

    tokenizer: Any            # encode(text) and decode(ids, skip_special_tokens=...), as the gateway's tokenizers
    chat_start: int           # a prompt holding this token is a chat (else a raw completion prompt)
    reply_end: int            # ends every reply that does not loop (the model's end of turn)
    last_user: re.Pattern[str]  # a user turn of the decoded chat prompt: its text, group 1


FAKE_VOCAB = Vocab(FakeTokenizer(), IM_START, IM_END, re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S))
# The fake tokenizer's ids whatever the vocabulary (as when the echo backends swapped a module global)
ALTERNATIVE = FAKE_VOCAB.tokenizer.encode("\u03b1")[0]  # alternatives are Greek letters: two UTF-8 bytes each


def fake_logprob(index: int, token_id: int, top: int) -> common_pb2.TokenLogprob:
    """Reply token ``index``'s entry: log-probability -(index + 1) / 8 (exact in float32), and
    ``top`` alternatives, the token itself first, then α, β, ... each 0.5 less likely."""
    logprob = -(index + 1) / 8
    alternatives = [(token_id, logprob)] + [(ALTERNATIVE + j, logprob - j / 2) for j in range(1, top)]
    return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, top=[
        common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in alternatives[:top]])


@dataclass
class Script:
    reply: list[int]           # token ids, ending with the vocabulary's reply_end unless looping
    loop: bool = False
    delay_s: float = 0.0
    batch: int = 1
    prefill_delay_s: float = 0.0
    fail_after: int | None = None
    late_handoff_s: float | None = None
    prefill_fail: int = 0
    handoff_fail: int = 0
    stuck_after: int | None = None

    def token(self, index: int) -> int:
        return self.reply[index % len(self.reply)] if self.loop else self.reply[index]

    def length(self) -> float:
        return float("inf") if self.loop else len(self.reply)


def scripted_message(prompt_ids: list[int], vocab: Vocab = FAKE_VOCAB) -> str:
    """The text the reply echoes: the last user turn of a chat prompt, else the whole (raw) prompt."""
    if vocab.chat_start not in prompt_ids:
        return vocab.tokenizer.decode(prompt_ids)
    users = vocab.last_user.findall(vocab.tokenizer.decode(prompt_ids, skip_special_tokens=False))
    return users[-1] if users else "ok"


def parse_script(prompt_ids: list[int], seed: int | None = None, vocab: Vocab = FAKE_VOCAB) -> Script:
    message = scripted_message(prompt_ids, vocab)
    options: dict[str, str | None] = {}
    while (m := _DIRECTIVE.match(message)) is not None:
        options[m.group(1)] = m.group(2)
        message = message[m.end():]
    if "draw" in options and seed is not None and message.split():
        words = message.split()
        message = " ".join(words[:1 + seed % len(words)])
    loop = "loop" in options
    reply = vocab.tokenizer.encode(message or "ok") + ([] if loop else [vocab.reply_end])
    return Script(
        reply=reply, loop=loop,
        delay_s=float(options.get("delay") or 0.0),
        batch=int(options.get("batch") or 1),
        prefill_delay_s=float(options.get("prefill_delay") or 0.0),
        fail_after=int(options["fail_after"]) if options.get("fail_after") else None,
        late_handoff_s=float(options["late_handoff"]) if options.get("late_handoff") else None,
        prefill_fail=int(options.get("prefill_fail") or 0),
        handoff_fail=int(options.get("handoff_fail") or 0),
        stuck_after=int(options["stuck_after"]) if options.get("stuck_after") else None,
    )


@dataclass
class Job:
    script: Script
    next_index: int            # of the reply token decode sends next
    remaining: int             # tokens decode may still send
    top_logprobs: int | None = None  # send fake_logprob entries with this many alternatives


@dataclass
class State:
    address: str
    block_size: int
    vocab: Vocab = FAKE_VOCAB
    prefill_instances: int = 1
    decode_instances: int = 1
    rejection: dict[str, Any] | None = None
    places: list[dict[str, Any]] = field(default_factory=list)
    prefills: list[dict[str, Any]] = field(default_factory=list)
    decode_events: list[dict[str, Any]] = field(default_factory=list)
    seen_keys: set[bytes] = field(default_factory=set)
    jobs: dict[str, dict[int, Job]] = field(default_factory=dict)  # handed off, not streaming yet: by choice
    streams: dict[str, asyncio.Task[Any]] = field(default_factory=dict)  # StreamTokens handlers
    streaming: dict[str, dict[int, Job]] = field(default_factory=dict)  # the running choices of each stream
    tombstones: set[str] = field(default_factory=set)
    aborts: list[dict[str, Any]] = field(default_factory=list)
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    outcome_delay_s: float = 0.0  # how long ReportOutcome takes before the scheduler has it (a loaded one)
    prefill_attempts: dict[str, int] = field(default_factory=dict)  # by the request's last user message
    models: set[str] = field(default_factory=lambda: {MODEL_ID})  # served by the instances it lists

    def hand_off(self, request_id: str, jobs: dict[int, Job]) -> None:
        if request_id in self.tombstones:
            self.decode_event(request_id, "refused")  # aborted before its handoff arrived
            return
        self.jobs[request_id] = jobs

    def decode_event(self, request_id: str, event: str) -> None:
        self.decode_events.append({"request_id": request_id, "event": event, "t": time.monotonic()})


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, state: State) -> None:
        self.state = state

    async def Place(
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        s = self.state
        s.places.append({
            "request_id": request.request_id, "model_id": request.model_id,
            "block_keys": [k.hex() for k in request.block_keys],
            "prompt_tokens": request.prompt_tokens, "max_tokens": request.max_tokens,
            "block_size": request.block_size, "n": request.n,
        })
        s.models.add(request.model_id)  # a gateway serving another tokenizer's model: list instances of it too
        if request.block_size != s.block_size:  # like the real scheduler: one block size per model
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"block_size {request.block_size} differs from the model's {s.block_size}")
        if s.rejection is not None:
            rejection, s.rejection = s.rejection, None
            return scheduler_pb2.Placement(rejection=scheduler_pb2.Rejection(**rejection))
        here = scheduler_pb2.InstanceRef(instance_id="fake", address=s.address)
        return scheduler_pb2.Placement(prefill=here, decode=here)

    async def ListInstances(self, request: Any, context: grpc.aio.ServicerContext) -> scheduler_pb2.ListInstancesReply:
        def status(role: int, i: int, model_id: str) -> scheduler_pb2.InstanceStatus:
            info = scheduler_pb2.InstanceInfo(instance_id=f"fake-{model_id}-{role}-{i}", role=role,
                                              address=self.state.address, model_id=model_id,
                                              block_size=self.state.block_size)
            return scheduler_pb2.InstanceStatus(info=info)

        instances = []
        for model_id in sorted(self.state.models):
            instances += [status(scheduler_pb2.INSTANCE_ROLE_PREFILL, i, model_id)
                          for i in range(self.state.prefill_instances)]
            instances += [status(scheduler_pb2.INSTANCE_ROLE_DECODE, i, model_id)
                          for i in range(self.state.decode_instances)]
        return scheduler_pb2.ListInstancesReply(instances=instances)

    async def ReportOutcome(self, request: scheduler_pb2.RequestOutcome,
                            context: grpc.aio.ServicerContext) -> scheduler_pb2.OutcomeReply:
        await asyncio.sleep(self.state.outcome_delay_s)
        self.state.outcomes.append({"request_id": request.request_id, "ttft_s": request.ttft_s,
                                    "released": request.released, "finished": request.finished,
                                    "t": time.monotonic()})
        return scheduler_pb2.OutcomeReply()


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, state: State) -> None:
        self.state = state

    def _cached_tokens(self, request: prefill_pb2.PrefillRequest) -> int:
        keys = prefix_block_keys(list(request.token_ids), self.state.block_size, request.model_id, request.cache_salt)
        hits = 0
        for key in keys:
            if key not in self.state.seen_keys:
                break
            hits += 1
        self.state.seen_keys.update(keys)
        return hits * self.state.block_size

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):  # noqa: ANN201
        s = request.sampling
        record = {
            "request_id": request.request_id, "model_id": request.model_id, "prompt_tokens": len(request.token_ids),
            "cache_salt": request.cache_salt.hex(), "decode_address": request.decode_address,
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "seed": s.seed if s.has_seed else None, "max_tokens": s.max_tokens,
            "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos, "first_step": s.first_step,
            "prefix_source_address": request.prefix_source_address, "token_ids": list(request.token_ids),
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty, "logit_bias": {str(k): v for k, v in s.logit_bias.items()},
            "min_tokens": s.min_tokens, "logprobs": s.logprobs, "top_logprobs": s.top_logprobs, "n": s.n,
            "constraint": json_format.MessageToDict(s.constraint) if s.HasField("constraint") else None,
            "outcome": "running", "started_t": time.monotonic(),
        }
        self.state.prefills.append(record)
        seed = s.seed if s.has_seed else None
        vocab = self.state.vocab
        scripts = [parse_script(list(request.token_ids), choice_seed(seed, i), vocab) for i in range(max(s.n, 1))]
        script = scripts[0]  # the directives are the same for every choice
        message = scripted_message(list(request.token_ids), vocab)
        tries = self.state.prefill_attempts[message] = self.state.prefill_attempts.get(message, 0) + 1
        try:
            await asyncio.sleep(script.prefill_delay_s)
            stuck = script.stuck_after is not None and s.first_step >= script.stuck_after
            if tries <= script.prefill_fail or stuck:
                record["outcome"] = "failed"
                await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill instance lost")
            cached = record["cached_tokens"] = self._cached_tokens(request)
            step = s.first_step  # a migrated request: the client has the reply up to here
            top = s.top_logprobs if s.logprobs else None
            record["first_token_t"] = time.monotonic()  # as it is sent
            jobs: dict[int, Job] = {}  # the choices decode continues
            for index, choice in enumerate(scripts):
                first = choice.token(step)
                finished = first == vocab.reply_end or s.max_tokens == 1
                reason = "stop" if first == vocab.reply_end else "length"
                if not finished:
                    jobs[index] = Job(choice, next_index=step + 1, remaining=s.max_tokens - 1, top_logprobs=top)
                yield prefill_pb2.PrefillEvent(first_token=prefill_pb2.FirstToken(
                    token_id=first, prompt_tokens=len(request.token_ids), cached_tokens=cached,
                    finished=finished, finish_reason=reason if finished else "", index=index,
                    logprob=fake_logprob(step, first, top) if top is not None else None,
                ))
            if jobs:
                if tries <= script.prefill_fail + script.handoff_fail:
                    record["outcome"] = "failed"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill instance lost before the handoff")
                self.state.hand_off(request.request_id, jobs)
                yield prefill_pb2.PrefillEvent(handed_off=prefill_pb2.HandedOff(decode_address=request.decode_address))
            record["outcome"] = "done"
        except (asyncio.CancelledError, GeneratorExit):
            record["outcome"] = "cancelled"
            if script.late_handoff_s is not None:
                # The handoff was already on its way: decode gets the request after the cancel.
                jobs = {i: Job(c, next_index=s.first_step + 1, remaining=s.max_tokens - 1) for i, c in enumerate(scripts)}
                asyncio.get_running_loop().call_later(script.late_handoff_s, self.state.hand_off,
                                                      request.request_id, jobs)
            raise


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, state: State) -> None:
        self.state = state

    async def StreamTokens(self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext):  # noqa: ANN201
        rid = request.request_id
        jobs = self.state.jobs.pop(rid, None)
        if jobs is None:  # like the real decode: a request not handed off (yet) is unknown
            self.state.decode_event(rid, "not_found")
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {rid}")
        self.state.decode_event(rid, "opened")
        self.state.streams[rid] = asyncio.current_task()  # type: ignore[assignment]
        self.state.streaming[rid] = jobs
        try:
            await context.send_initial_metadata(())
            rounds = 0
            script = next(iter(jobs.values())).script if jobs else None
            while jobs and script is not None:
                await asyncio.sleep(script.delay_s)
                if script.fail_after is not None and rounds >= script.fail_after:
                    self.state.decode_event(rid, "failed")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "decode instance lost")
                for index in sorted(jobs):
                    if index in jobs:  # not aborted while an earlier choice's event was sent
                        yield self._next_event(index, jobs, self.state.vocab.reply_end)
                rounds += 1
            self.state.decode_event(rid, "completed")
        except (asyncio.CancelledError, GeneratorExit):
            # A cancelled call surfaces as CancelledError at an await, or GeneratorExit at a `yield`.
            self.state.decode_event(rid, "cancelled")
            raise
        finally:
            self.state.streams.pop(rid, None)
            self.state.streaming.pop(rid, None)

    @staticmethod
    def _next_event(index: int, jobs: dict[int, Job], reply_end: int) -> decode_pb2.TokenEvent:
        """Choice ``index``'s next event; a finished choice leaves ``jobs``."""
        job = jobs[index]
        ids, logprobs, reason = [], [], ""
        while len(ids) < job.script.batch and not reason:
            token = job.script.token(job.next_index)
            ids.append(token)
            if job.top_logprobs is not None:
                logprobs.append(fake_logprob(job.next_index, token, job.top_logprobs))
            job.next_index += 1
            job.remaining -= 1
            reason = "stop" if token == reply_end else "length" if job.remaining <= 0 else ""
        if reason:
            del jobs[index]
        return decode_pb2.TokenEvent(token_ids=ids, finished=bool(reason), finish_reason=reason, index=index,
                                     logprobs=logprobs)

    async def Abort(self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> decode_pb2.AbortReply:
        rid = request.request_id
        self.state.aborts.append({"request_id": rid, "reason": request.reason, "t": time.monotonic(),
                                  "one_choice": request.one_choice, "index": request.index})
        if request.one_choice:  # the choice stops; the stream goes on with the others
            jobs = self.state.streaming.get(rid, self.state.jobs.get(rid, {}))
            found = jobs.pop(request.index, None) is not None
            self.state.decode_event(rid, f"aborted choice {request.index}" if found else "choice not found")
            return decode_pb2.AbortReply(found=found)
        found = self.state.jobs.pop(rid, None) is not None
        stream = self.state.streams.get(rid)
        if stream is not None:
            found = True
            stream.cancel()
        if not found:
            self.state.tombstones.add(rid)
        self.state.decode_event(rid, "aborted" if found else "tombstone")
        return decode_pb2.AbortReply(found=found)


def control_app(state: State) -> FastAPI:
    app = FastAPI()

    @app.post("/reject")
    def reject(body: dict[str, Any]) -> dict[str, str]:
        state.rejection = body
        return {"status": "armed"}

    @app.put("/instances")
    def instances(body: dict[str, int]) -> dict[str, int]:
        state.prefill_instances, state.decode_instances = body["prefill"], body["decode"]
        return body

    @app.put("/block-size")
    def block_size(body: dict[str, int]) -> dict[str, int]:
        state.block_size = body["block_size"]  # as if the model's instances were redeployed
        return body

    @app.put("/outcome-delay")
    def outcome_delay(body: dict[str, float]) -> dict[str, float]:
        state.outcome_delay_s = body["seconds"]
        return body

    @app.get("/places")
    def places() -> list[dict[str, Any]]:
        return state.places

    @app.get("/prefills")
    def prefills() -> list[dict[str, Any]]:
        return state.prefills

    @app.get("/jobs")
    def jobs() -> list[str]:
        return sorted(state.jobs)

    @app.get("/aborts")
    def aborts() -> list[dict[str, Any]]:
        return state.aborts

    @app.get("/outcomes")
    def outcomes() -> list[dict[str, Any]]:
        return state.outcomes

    @app.get("/decode-events")
    def decode_events() -> list[dict[str, Any]]:
        return state.decode_events

    return app


async def start(port: int, control_port: int, block_size: int,
                vocab: Vocab = FAKE_VOCAB) -> Callable[[], Awaitable[None]]:
    """Serve the fakes and the control API on the running loop; returns what stops them."""
    state = State(address=f"127.0.0.1:{port}", block_size=block_size, vocab=vocab)
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(FakeScheduler(state), server)
    prefill_pb2_grpc.add_PrefillServicer_to_server(FakePrefill(state), server)
    decode_pb2_grpc.add_DecodeServicer_to_server(FakeDecode(state), server)
    if server.add_insecure_port(state.address) == 0:
        raise SystemExit(f"cannot listen on {state.address}")
    await server.start()
    control = AdminServer(control_app(state), "127.0.0.1", control_port)
    await control.start()

    async def stop() -> None:
        await server.stop(0.5)
        await control.stop()

    return stop


async def run(port: int, control_port: int, block_size: int, vocab: Vocab) -> None:
    """The process: ``start``, then serve until SIGINT or SIGTERM."""
    stop_serving = await start(port, control_port, block_size, vocab)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await stop_serving()


def main(vocab: Callable[[], Vocab] = lambda: FAKE_VOCAB) -> None:
    """The process's entry; ``vocab`` is called once the arguments are read (a real tokenizer loads then)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run(args.port, args.control_port, args.block_size, vocab()))


if __name__ == "__main__":
    main()

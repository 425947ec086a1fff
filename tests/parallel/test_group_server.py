"""Real prefill and decode servers each leading a tensor-parallel group of three processes
(SmolLM2 has three KV heads, so three ranks of one head each), their workers started as
``crescent serve <role>-worker``, on loopback, beside a one-process prefill.

What a user would notice: each group registers one instance, with the block layout of a
one-process instance; a request streams the tokens a single process computes, whether its
blocks were handed in directly, gathered from a group prefill's ranks, or sent a layer at a
time by the one-process prefill; /metrics says the
instance spans three processes; a worker killed ends the leader (non-zero, a clear log line)
within the collective timeout instead of hanging it, and the other worker follows; settings
that cannot run stop the process at start with the numbers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import grpc

from crescent.protos import common_pb2, prefill_pb2, prefill_pb2_grpc
from crescent.services.engine.parallel.group import EXIT_GROUP_BROKEN
from tests.decode.process import TEXTS, DecodeProcess, PromptKv, SchedulerStandIn, decode_stub, stream_all
from tests.ports import free_port

pytestmark = pytest.mark.slow  # real processes: a model load each

SIZE = 3
TIMEOUT_S = 15.0  # the group's collective timeout: a lost worker must end the leader well within a test's time
CRESCENT = str(Path(sys.executable).parent / "crescent")


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", CRESCENT_LOG_LEVEL="INFO")


@dataclass
class Group:
    """A role's server leading ``SIZE - 1`` workers (``crescent serve <role>-worker``)."""

    leader: DecodeProcess
    workers: list[tuple[subprocess.Popen[bytes], Path]]

    def stop(self) -> None:
        self.leader.stop()
        for proc, _ in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_group(run_dir: Path, scheduler_address: str, role: str) -> Group:
    run_dir.mkdir()
    leader = DecodeProcess(run_dir, scheduler_address, 16 * 64, role=role)
    config = yaml.safe_load(leader.config.read_text())
    config["engine"]["parallel"] = {"group_size": SIZE, "port": free_port(), "timeout_s": TIMEOUT_S,
                                    "startup_timeout_s": 120}
    leader.config.write_text(yaml.safe_dump(config))
    workers = []
    for rank in range(1, SIZE):
        log = run_dir / f"worker{rank}.log"
        with open(log, "wb") as out:
            env = {**_env(), f"CRESCENT_{role.upper()}__ENGINE__PARALLEL__RANK": str(rank)}
            workers.append((subprocess.Popen([CRESCENT, "serve", f"{role}-worker", "--config", str(leader.config)],
                                             stdout=out, stderr=subprocess.STDOUT, env=env), log))
    group = Group(leader, workers)
    try:
        leader.start(wait_ready=False)
    except BaseException:
        group.stop()
        raise
    return group


def wait_ready(*processes: DecodeProcess) -> None:
    deadline = time.monotonic() + 180
    for process in processes:
        while not process.healthy():
            if process.proc is None or process.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{process.role} did not become ready:\n" + process.log.read_text()[-3000:])
            time.sleep(0.1)


@pytest.fixture(scope="module")
def prompts() -> PromptKv:
    return PromptKv()


@dataclass
class Deployment:
    scheduler: SchedulerStandIn
    decode: Group            # a tensor-parallel decode instance
    prefill: Group           # a tensor-parallel prefill instance
    solo_prefill: DecodeProcess  # a one-process prefill (hands off layer by layer)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    run_dir = tmp_path_factory.mktemp("tp")
    scheduler = SchedulerStandIn()
    started: list = []
    try:
        decode = start_group(run_dir / "decode", scheduler.address, "decode")
        started.append(decode)
        prefill = start_group(run_dir / "prefill", scheduler.address, "prefill")
        started.append(prefill)
        (run_dir / "solo").mkdir()
        solo = DecodeProcess(run_dir / "solo", scheduler.address, 16 * 64, role="prefill")
        started.append(solo)
        solo.start(wait_ready=False)
        wait_ready(decode.leader, prefill.leader, solo)
        yield Deployment(scheduler, decode, prefill, solo)
    finally:
        for item in reversed(started):
            item.stop()
        scheduler.stop()


def prefill_to(prefill: DecodeProcess, decode: DecodeProcess, request_id: str, tokens: list[int],
               max_tokens: int) -> list[int]:
    """A request through a real prefill and decode: every token the user gets."""
    with grpc.insecure_channel(prefill.address) as channel:
        events = list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, token_ids=tokens, decode_address=decode.address,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)), timeout=120))
    assert [e.WhichOneof("event") for e in events] == ["first_token", "handed_off"]
    channel, stub = decode_stub(decode.address)
    with channel:
        rest, reason = stream_all(stub, request_id)
    assert reason == "length"
    return [events[0].first_token.token_id, *rest]


def test_each_group_registers_one_instance_with_single_process_tokens(deployment: Deployment,
                                                                        prompts: PromptKv) -> None:
    leaders = {deployment.decode.leader.address, deployment.prefill.leader.address}
    registered = {i.instance_id: i for i in deployment.scheduler.servicer.registered if i.address in leaders}
    assert len(registered) == 2  # one instance per group, not one per process
    for info in registered.values():  # the block layout of a one-process instance: handoffs and kvstore agree
        assert info.kv_format == "paged-v1:" + "x".join(str(d) for d in prompts.engine.cache.block_shape)
    decode = deployment.decode.leader
    assert decode.metric("crescent_engine_parallel_group_size", role="decode") == SIZE
    assert deployment.prefill.leader.metric("crescent_engine_parallel_group_size", role="prefill") == SIZE
    channel, stub = decode_stub(decode.address)
    with channel:  # a handoff written into the group's shards
        tokens = prompts.prompt(TEXTS[0])
        first, parts = prompts.handoff("tp-0", tokens, 16)
        assert stub.Handoff(iter(parts), timeout=60).accepted
        streamed, reason = stream_all(stub, "tp-0")
    assert reason == "length" and [first, *streamed] == prompts.reference(tokens, 16)


def test_a_group_prefill_hands_whole_blocks_to_a_group_decode(deployment: Deployment, prompts: PromptKv) -> None:
    prefill = deployment.prefill.leader
    tokens = prompts.prompt(TEXTS[1] * 8)[: 2 * 64 + 9]
    assert prefill_to(prefill, deployment.decode.leader, "whole", tokens, 12) == prompts.reference(tokens, 12)
    token_bytes = prompts.engine.cache.token_layer_bytes() * prompts.engine.config.num_layers
    # The blocks were gathered from the prefill's ranks, whole: nothing went before the last layer.
    assert prefill.metric("crescent_engine_kv_transfer_bytes_total", direction="handoff_out") == len(tokens) * token_bytes
    assert prefill.metric("crescent_engine_kv_transfer_bytes_total", direction="handoff_hidden") == 0


def test_a_layer_wise_handoff_from_a_one_process_prefill_decodes_the_same(deployment: Deployment,
                                                                           prompts: PromptKv) -> None:
    solo = deployment.solo_prefill
    tokens = prompts.prompt(TEXTS[2] * 8)[: 2 * 64 + 9]
    assert prefill_to(solo, deployment.decode.leader, "layers", tokens, 12) == prompts.reference(tokens, 12)
    token_bytes = prompts.engine.cache.token_layer_bytes() * prompts.engine.config.num_layers
    assert solo.metric("crescent_engine_kv_transfer_bytes_total", direction="handoff_out") == len(tokens) * token_bytes


def test_a_killed_worker_ends_the_leader_within_the_timeout(deployment: Deployment) -> None:
    leader, ((victim, _), (survivor, survivor_log)) = deployment.decode.leader, deployment.decode.workers
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    assert leader.proc is not None
    code = leader.proc.wait(timeout=4 * TIMEOUT_S)  # not a hang
    took = time.monotonic() - killed
    log = leader.log.read_text(errors="replace")
    assert code == EXIT_GROUP_BROKEN, log[-3000:]
    assert "lost the group" in log and "exiting (code 3) so the group restarts together" in log
    assert took < 2 * TIMEOUT_S, f"the leader noticed after {took:.1f} s"
    assert survivor.wait(timeout=4 * TIMEOUT_S) == EXIT_GROUP_BROKEN  # its leader gone, the worker leaves too
    assert "lost the group" in survivor_log.read_text(errors="replace")


@pytest.mark.parametrize(
    ("service", "rank", "says"),
    [
        ("decode", "", "engine.parallel.group_size 2: a tensor-parallel group of 2 needs num_kv_heads (3) divisible by 2"),
        ("decode", "1", "engine.parallel.rank is 1: the serving process is the group's leader (rank 0)"),
        ("decode-worker", "0", "engine.parallel.rank is 0 (group of 2): rank 0 is the leader"),
        ("decode-worker", "2", "engine.parallel.rank 2 is outside a group of 2 processes (ranks 0..1)"),
    ],
)
def test_group_settings_that_cannot_run_stop_the_process_at_start(tmp_path: Path, service: str, rank: str,
                                                                   says: str) -> None:
    config = tmp_path / "decode.yaml"
    config.write_text(yaml.safe_dump({"scheduler_address": "127.0.0.1:1", "engine": {
        "threads": 1, "parallel": {"group_size": 2, "port": free_port(), "startup_timeout_s": 5}}}))
    env = _env() if not rank else {**_env(), "CRESCENT_DECODE__ENGINE__PARALLEL__RANK": rank}
    result = subprocess.run([CRESCENT, "serve", service, "--config", str(config)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert says in " ".join(result.stderr.split()), result.stderr[-2000:]

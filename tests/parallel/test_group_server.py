"""A real decode server leading a tensor-parallel group of three processes (SmolLM2 has three
KV heads, so three ranks of one head each), its workers started as ``crescent serve
decode-worker``, on loopback.

What a user would notice: one instance registers, with the block layout of a one-process
instance; a handed-off request streams the tokens a single process computes, whether the blocks
come whole or a layer at a time from a real one-process prefill; /metrics says the
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


def start_worker(config: Path, rank: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([CRESCENT, "serve", "decode-worker", "--config", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, env={**_env(), "CRESCENT_DECODE__ENGINE__PARALLEL__RANK": str(rank)})


@pytest.fixture(scope="module")
def prompts() -> PromptKv:
    return PromptKv()


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DecodeProcess, list, SchedulerStandIn, DecodeProcess]]:
    run_dir = tmp_path_factory.mktemp("tp-decode")
    scheduler = SchedulerStandIn()
    leader = DecodeProcess(run_dir, scheduler.address, 16 * 64)
    config = yaml.safe_load(leader.config.read_text())
    config["engine"]["parallel"] = {"group_size": SIZE, "port": free_port(), "timeout_s": TIMEOUT_S,
                                    "startup_timeout_s": 120}
    leader.config.write_text(yaml.safe_dump(config))
    workers = [(start_worker(leader.config, rank, run_dir / f"worker{rank}.log"), run_dir / f"worker{rank}.log")
               for rank in range(1, SIZE)]
    prefill = DecodeProcess(run_dir, scheduler.address, 16 * 64, role="prefill")  # one process, layer-wise handoff
    try:
        prefill.start(wait_ready=False)
        leader.start()
        deadline = time.monotonic() + 120
        while not prefill.healthy():
            assert prefill.proc.poll() is None and time.monotonic() < deadline, prefill.log.read_text()[-3000:]
            time.sleep(0.1)
        yield leader, workers, scheduler, prefill
    finally:
        prefill.stop()
        leader.stop()
        for proc, _ in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        scheduler.stop()


def test_the_group_serves_one_instance_with_single_process_tokens(group, prompts: PromptKv) -> None:
    leader, _, scheduler, prefill = group
    registered = {i.instance_id: i for i in scheduler.servicer.registered if i.address != prefill.address}
    (info,) = registered.values()  # one decode instance, not three
    assert info.kv_format == "paged-v1:" + "x".join(str(d) for d in prompts.engine.cache.block_shape)
    assert leader.metric("crescent_engine_parallel_group_size", role="decode") == SIZE
    channel, stub = decode_stub(leader.address)
    with channel:
        for i, text in enumerate(TEXTS[:2]):
            tokens = prompts.prompt(text)
            first, parts = prompts.handoff(f"tp-{i}", tokens, 16)
            assert stub.Handoff(iter(parts), timeout=60).accepted
            streamed, reason = stream_all(stub, f"tp-{i}")
            assert reason == "length"
            assert [first, *streamed] == prompts.reference(tokens, 16)


def test_a_layer_wise_handoff_from_a_one_process_prefill_decodes_the_same(group, prompts: PromptKv) -> None:
    leader, _, _, prefill = group
    tokens = prompts.prompt(TEXTS[2] * 8)[: 2 * 64 + 9]
    with grpc.insecure_channel(prefill.address) as channel:
        events = list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id="layers", token_ids=tokens, decode_address=leader.address,
            sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True)), timeout=120))
    assert [e.WhichOneof("event") for e in events] == ["first_token", "handed_off"]
    token_bytes = prompts.engine.cache.token_layer_bytes() * prompts.engine.config.num_layers
    assert prefill.metric("crescent_engine_kv_transfer_bytes_total", direction="handoff_out") == len(tokens) * token_bytes
    channel, stub = decode_stub(leader.address)
    with channel:
        rest, reason = stream_all(stub, "layers")
    assert [events[0].first_token.token_id, *rest] == prompts.reference(tokens, 12) and reason == "length"


def test_a_killed_worker_ends_the_leader_within_the_timeout(group) -> None:
    leader, workers, _, _ = group
    (victim, _), (survivor, survivor_log) = workers
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

"""A real decode process on loopback, a stand-in scheduler that records what it hears, and
handoffs made by the same model computing prompts in the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import torch
import yaml

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.loader import load_model
from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
from crescent.services.instance.wire import kv_dtype, payload_bytes
from tests.ports import free_port

BLOCK = 64

# Prompts for the process tests: distinct openings, so no two share a prefix block.
TEXTS = [
    "The lighthouse keeper counted the ships that passed the rocky point every night, and he wrote",
    "In the valley below the mountains, farmers grew apples, pears and plums, and every autumn they",
    "A short history of the printing press: movable type changed how books were made, because it",
    "The recipe for bread is simple: flour, water, salt and yeast, mixed and left to rise until it",
    "Our team meeting covered three topics today: the release schedule, the hiring plan and the",
]


@dataclass
class RecordingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Answers Register/Heartbeat/Deregister like the scheduler and keeps every message;
    ``refuse`` makes Register fail with FAILED_PRECONDITION."""

    refuse: str = ""
    registered: list[scheduler_pb2.InstanceInfo] = field(default_factory=list)
    loads: list[scheduler_pb2.InstanceLoad] = field(default_factory=list)
    deregistered: list[str] = field(default_factory=list)

    def Register(self, request, context):
        if self.refuse:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse)
        self.registered.append(request)
        return scheduler_pb2.RegisterReply(heartbeat_interval_ms=200)

    def Heartbeat(self, request, context):
        self.loads.append(request)
        return scheduler_pb2.HeartbeatReply(known=True)

    def Deregister(self, request, context):
        self.deregistered.append(request.instance_id)
        return scheduler_pb2.DeregisterReply()

    def PublishBlockEvents(self, request, context):
        return scheduler_pb2.EventsReply()

    def finished_ids(self) -> set[str]:
        return {rid for load in list(self.loads) for rid in load.finished_request_ids}


class SchedulerStandIn:
    def __init__(self, refuse: str = "") -> None:
        self.servicer = RecordingScheduler(refuse=refuse)
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0)


class DecodeProcess:
    """``crescent serve decode`` (or ``prefill``) as the CLI runs it: ``server.main(config)`` in its own process."""

    def __init__(self, run_dir: Path, scheduler_address: str, kv_capacity_tokens: int, *, max_batch_size: int = 8,
                 drain_grace_s: float = 100.0, role: str = "decode", extra: dict | None = None) -> None:
        self.role = role
        self.port, self.admin_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.config = run_dir / f"{role}.yaml"
        self.config.write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": self.port, "admin_port": self.admin_port},
            "scheduler_address": scheduler_address,
            "engine": {"kv_capacity_tokens": kv_capacity_tokens, "block_size": BLOCK, "threads": 1,
                       "max_batch_size": max_batch_size, "drain_grace_s": drain_grace_s},
            **(extra or {}),  # e.g. a prefill's kvstore_address
        }))
        self.log = run_dir / f"{role}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0, wait_ready: bool = True) -> None:
        code = ("import sys; from pathlib import Path; "
                f"from crescent.services.{self.role}.server import main; main(Path(sys.argv[1]))")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.config)], stdout=log,
                                         stderr=subprocess.STDOUT, env=dict(os.environ, CRESCENT_LOG_LEVEL="INFO"))
        deadline = time.monotonic() + timeout_s
        while wait_ready and not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.role} did not become ready:\n" + self.log.read_text(errors="replace")[-3000:])
            time.sleep(0.1)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.admin_port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def health_status(self) -> int:
        return httpx.get(f"http://127.0.0.1:{self.admin_port}/health", timeout=1).status_code

    def kv_used_tokens(self) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=2).text
        line = next(line for line in text.splitlines() if line.startswith("crescent_engine_kv_used_tokens{"))
        return float(line.rsplit(" ", 1)[1])

    def metric(self, name: str, **labels: str) -> float:
        """One sample on /metrics whose labels include ``labels`` (0 when absent)."""
        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=2).text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class PromptKv:
    """The same model as the decode process, computing prompts here as a prefill instance would."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        loaded = load_model(resolve_model(DEFAULT_MODEL), progress=False)
        self.tokenizer = loaded.tokenizer
        self.engine = Engine(LlamaModel(loaded.config, loaded.weights), model_id=loaded.model_id,
                             kv_capacity_tokens=4096, block_size=BLOCK)
        self._lock = threading.Lock()

    def prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def reference(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Greedy generation in this process, end-of-sequence ignored: what decode must stream."""
        with self._lock:
            return self.engine.generate(tokens, max_tokens, stop_token_ids=[])

    def handoff(self, request_id: str, tokens: list[int], max_tokens: int) -> tuple[int, list[decode_pb2.HandoffPart]]:
        """(first token, the Handoff stream prefill would send)."""
        with self._lock:
            seq = self.engine.add_sequence(request_id, tokens, use_cache=False)
            try:
                first = int(torch.argmax(self.engine.prefill(seq)))
                blobs = [payload_bytes(self.engine.block_payload(seq, i, min(BLOCK, len(tokens) - i * BLOCK)))
                         for i in range(-(-len(tokens) // BLOCK))]
            finally:
                self.engine.release(seq)
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        parts = [decode_pb2.HandoffPart(header=decode_pb2.HandoffHeader(
            request_id=request_id, model_id=self.engine.model_id, prompt_token_ids=tokens, first_token_id=first,
            sampling=sampling, kv_dtype=kv_dtype(self.engine.cache), kv_block_shape=list(self.engine.cache.block_shape),
            num_blocks=len(blobs),
        ))]
        for i, blob in enumerate(blobs):
            shape = list(self.engine.cache.payload_shape(min(BLOCK, len(tokens) - i * BLOCK)))
            meta = common_pb2.BlockMeta(key=f"{request_id}/{i}".encode(), model_id=self.engine.model_id,
                                        dtype=kv_dtype(self.engine.cache), shape=shape, nbytes=len(blob), found=True)
            # Built with the generated code: the reference the decode server's own codec must read.
            parts.append(decode_pb2.HandoffPart(block=common_pb2.BlockChunk(meta=meta, data=blob, last=True)))
        return first, parts


def decode_stub(address: str) -> tuple[grpc.Channel, decode_pb2_grpc.DecodeStub]:
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 80 << 20),
                                                      ("grpc.max_receive_message_length", 80 << 20)])
    return channel, decode_pb2_grpc.DecodeStub(channel)


def stream_all(stub: decode_pb2_grpc.DecodeStub, request_id: str) -> tuple[list[int], str]:
    """Every token StreamTokens sends and the finish reason (a gRPC error propagates)."""
    tokens, reason = [], ""
    for event in stub.StreamTokens(decode_pb2.StreamRequest(request_id=request_id), timeout=120):
        tokens.extend(event.token_ids)
        reason = event.finish_reason or reason
    return tokens, reason

"""Put/get throughput of a kvstore node per tier and block size, through every byte mover on
loopback (gRPC streams, shared memory, the TCP side channel, NIXL where installed), next to a
plain memcpy of the same bytes (the limit on this machine); and the prefill -> decode handoff.

    .venv/bin/python loadtest/bench_kvstore.py [--sizes-mib 1 4 16 64] [--total-mib 256] [--tiers host disk s3]
                                               [--movers grpc shm tcp nixl] [--tls off|on|both] [--handoff]

The host tier runs every mover in ``--movers``; disk and S3 run gRPC (the mover does not change
what those media cost). A mover that is not usable here (NIXL not installed) is reported as the
mover that served instead. ``--handoff`` also times a 2k-token prompt's handoff, before and
after the one-codec change (``bench_handoff.py``).

Starts its own node (and a moto S3 server for the s3 tier) on 127.0.0.1; prints one line per
case and a JSON line at the end. ``--tls both`` runs every gRPC case plaintext and with mutual
TLS (a node and a client certificate from a throwaway CA, as ``crescent up`` makes them) and,
for the host tier, what mTLS costs as a share of plaintext throughput: two nodes alike but for
TLS, their rounds alternated and compared pair by pair (``paired_mtls``), so the VM's drifting
speed cancels out of the ratio; the other movers (the TCP side channel) run once plaintext and
once with mTLS.

Each case also reports the CPU seconds per GB moved in the client and in the node (timed puts
and gets only) and the 1-minute load average when it started: on a shared machine the CPU per
GB holds still where the GB/s swing. The run ends with the TCP side channel's share of the
same-round memcpy per block size, plaintext and mTLS, next to what plain loopback TCP moves
(one and two connections) in the same run.

    .venv/bin/python loadtest/bench_kvstore.py --tiers host --movers tcp --sizes-mib 4 16 64 --tls both
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml
from dataclasses import dataclass

from crescent.services.contract.block_keys import prefix_block_keys
from crescent.services.common.certs import make_pki
from crescent.services.common.ports import unused_port
from crescent.services.common.tls import PeerTls, TlsSettings, load_tls
from crescent.services.kvwire import side_channel
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.kvstore.client import MOVERS, KvStoreClient
from crescent.services.kvstore.memory import keep_large_buffers_warm

import bench_handoff  # noqa: E402 - a sibling script
import transport_ceiling  # noqa: E402 - a sibling script

MIB = 1 << 20


def free_port() -> int:
    return unused_port()


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(url)


class Memcpy:
    """A plain copy of ``count`` distinct blocks of ``nbytes`` (as many bytes as a case moves,
    so caches do not flatter it) between warm buffers: the machine's limit for moving them.
    Timed in every round, next to the case, so the ratio does not drift with a noisy VM."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes, self.count = nbytes, count
        self.src = np.frombuffer(os.urandom(nbytes * count), dtype=np.uint8).reshape(count, nbytes)
        self.dst = np.ones_like(self.src)  # touched first: we measure copying, not page faults

    def gbps(self) -> float:
        seconds = _timed(lambda: [np.copyto(self.dst[i], self.src[i]) for i in range(self.count)])
        return self.nbytes * self.count / seconds / 1e9


def cpu_model() -> str:
    """The CPU, cores and the vector flags that matter here (figures are only comparable with these)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in ("avx2", "avx512f", "vpclmulqdq", "pclmulqdq") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(wanted)}"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def tier_config(tier: str, workdir: Path, s3_endpoint: str | None, capacity: int, chunk: int) -> dict:
    tiers: dict = {"host": {"capacity_bytes": capacity, "high_watermark": 1.0, "low_watermark": 1.0, "prefault": True}}
    if tier in ("disk", "s3"):
        tiers["host"]["enabled"] = False
    if tier == "disk":
        tiers["disk"] = {"enabled": True, "path": str(workdir / "disk"), "capacity_bytes": capacity}
    if tier == "s3":
        tiers["s3"] = {
            "enabled": True, "endpoint_url": s3_endpoint, "bucket": "bench", "region": "us-east-1",
            "access_key_id": "bench", "secret_access_key": "bench", "create_bucket": True, "prefix": "kv/",
            "capacity_bytes": capacity, "write_queue_blocks": 4096, "timeout_s": 30,
        }
    return {"tiers": tiers, "max_block_bytes": 128 * MIB, "max_chunk_bytes": chunk}


def make_blocks(size: int, count: int, salt: bytes) -> list[KvBlock]:
    payload = os.urandom(size)  # same bytes for every block: we measure transfer, not RNG
    keys = prefix_block_keys(list(range(count * 4)), 4, "bench", salt)
    return [
        KvBlock.build(k, None, "bench", "uint8", (size,), (1, 2, 3, 4), payload) for k in keys
    ]


S3_ENDPOINT: str | None = None


def _s3():
    import boto3

    return boto3.client("s3", endpoint_url=S3_ENDPOINT, region_name="us-east-1",
                        aws_access_key_id="bench", aws_secret_access_key="bench")


def s3_object_names() -> set[str]:
    pages = _s3().get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="kv/")
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def raw_tier_gbps(tier: str, size: int, count: int, workdir: Path) -> tuple[float, float]:
    """The same bytes through the tier's medium with no kvstore: plain files, or boto3 to S3."""
    payload = os.urandom(size)
    if tier == "disk":
        root = workdir / "raw"
        root.mkdir(exist_ok=True)
        put = _timed(lambda: [(root / str(i)).write_bytes(payload) for i in range(count)])
        get = _timed(lambda: [(root / str(i)).read_bytes() for i in range(count)])
        shutil.rmtree(root)
    else:
        s3 = _s3()
        put = _timed(lambda: [s3.put_object(Bucket="bench", Key=f"raw/{i}", Body=payload) for i in range(count)])
        get = _timed(lambda: [s3.get_object(Bucket="bench", Key=f"raw/{i}")["Body"].read() for i in range(count)])
        for i in range(count):
            s3.delete_object(Bucket="bench", Key=f"raw/{i}")
    return size * count / put / 1e9, size * count / get / 1e9


async def tier_alone_gbps(tier: str, size: int, count: int, workdir: Path) -> tuple[float, float]:
    """The kvstore's own tier code in this process, no gRPC hop: writes until stored, reads
    each block back and verifies it, as the store does. Next to ``raw_tier_gbps`` it shows
    whether our client or the medium sets the pace."""
    from crescent.services.common.metrics import kvstore_metrics
    from crescent.services.kvstore.config import DiskTierSettings, S3TierSettings
    from crescent.services.kvstore.disk_tier import DiskTier
    from crescent.services.kvstore.s3_tier import S3Tier

    config = tier_config(tier, workdir, S3_ENDPOINT, (count + 2) * size * 2, MIB)["tiers"][tier]
    store = (DiskTier(DiskTierSettings(**{**config, "path": str(workdir / "alone")})) if tier == "disk"
             else S3Tier(S3TierSettings(**{**config, "prefix": "alone/"}), kvstore_metrics()))
    await store.start()
    try:
        if isinstance(store, S3Tier):
            await store.indexed.wait()
        blocks = make_blocks(size, count, b"alone")
        start = time.perf_counter()
        for block in blocks:
            assert await store.write(block)
        if isinstance(store, S3Tier):
            await store.flush(300)
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        for block in blocks:
            got = await store.read(block.key)
            assert got is not None
            got.verify(None)
        get_s = time.perf_counter() - start
        for block in blocks:
            await store.delete(block.key)
    finally:
        await store.close()
    return size * count / put_s / 1e9, size * count / get_s / 1e9


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) another process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds this process and the node spend inside the timed windows."""

    def __init__(self, node_pid: int | None) -> None:
        self.node_pid = node_pid if node_pid is not None and Path(f"/proc/{node_pid}/stat").exists() else None
        self.client_s = self.node_s = 0.0

    def __enter__(self) -> CpuMeter:
        self._client0 = time.process_time()
        self._node0 = process_cpu_s(self.node_pid) if self.node_pid else 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.client_s += time.process_time() - self._client0
        if self.node_pid:
            self.node_s += process_cpu_s(self.node_pid) - self._node0


@dataclass
class CaseResult:
    mover: str  # the one that served ("put/get" when they differ; another than asked when it is not usable here)
    put_gbps: float
    get_gbps: float
    memcpy_gbps: float
    put_pct: float  # median over rounds of put / memcpy in the same round
    get_pct: float
    client_cpu_s_per_gb: float  # put and get bytes together
    node_cpu_s_per_gb: float | None


async def run_case(
    address: str, size: int, count: int, mover: str, tier: str, chunk: int, per_call: int, rounds: int,
    tls: PeerTls | None = None, node_pid: int | None = None,
) -> CaseResult:
    """Medians over ``rounds`` rounds, each moving ``count`` new blocks and timing a memcpy of
    the same bytes between the put and the get."""
    client = KvStoreClient(address, movers=[mover], timeout_s=300, max_chunk_bytes=chunk, tls=tls)
    memcpy = Memcpy(size, count)
    cpu = CpuMeter(node_pid)
    puts, gets, copies = [], [], []
    try:
        spare = make_blocks(size, 1, b"warm-up")
        await client.put(spare)  # warm the channel and the pool mapping
        await client.get([spare[0].key], "bench")
        await client.remove([spare[0].key])
        for r in range(rounds):
            blocks = make_blocks(size, count, f"{tier}-{size}-{mover}-{r}".encode())
            batches = [blocks[i : i + per_call] for i in range(0, count, per_call)]
            start = time.perf_counter()
            with cpu:
                for batch in batches:
                    result = await client.put(batch)
                    assert result.stored == len(batch), result
            put_s = time.perf_counter() - start
            put_mover = client.mover
            if tier == "s3":  # a put to S3 returns once queued: wait until the objects are there
                wanted = {f"kv/{b.key.hex()}" for b in blocks}
                while not wanted <= s3_object_names():
                    await asyncio.sleep(0.01)
                put_s = time.perf_counter() - start
            copies.append(memcpy.gbps())
            start = time.perf_counter()
            got = 0
            with cpu:
                for batch in batches:
                    got += len(await client.get([b.key for b in batch], "bench"))
            get_s = time.perf_counter() - start
            assert got == count, f"only {got}/{count} blocks came back"
            await client.remove([b.key for b in blocks])
            puts.append(size * count / put_s / 1e9)
            gets.append(size * count / get_s / 1e9)
        median = statistics.median
        served = put_mover if put_mover == client.mover else f"{put_mover}/{client.mover}"  # put / get
        moved_gb = 2 * size * count * rounds / 1e9
        return CaseResult(
            served, median(puts), median(gets), median(copies),
            100 * median(p / c for p, c in zip(puts, copies)), 100 * median(g / c for g, c in zip(gets, copies)),
            cpu.client_s / moved_gb, cpu.node_s / moved_gb if cpu.node_pid else None,
        )
    finally:
        await client.close()


def policy_hit_rates(capacity_blocks: int = 512, requests: int = 20000, seed: int = 0) -> dict[str, float]:
    """Block hit rate of each eviction policy on a synthetic trace: multi-turn conversations
    with Zipf popularity whose prefixes are re-read, mixed with one-off long prompts (20%)."""
    import random

    from crescent.services.kvstore.eviction import make_eviction_policy, policy_names

    rng = random.Random(seed)
    conversations = 400
    weights = [1 / (i + 1) for i in range(conversations)]
    trace: list[list[bytes]] = []
    for r in range(requests):
        if rng.random() < 0.2:
            trace.append([f"once-{r}-{i}".encode() for i in range(16)])
        else:
            conv = rng.choices(range(conversations), weights)[0]
            trace.append([f"conv-{conv}-{i}".encode() for i in range(rng.randint(4, 16))])
    rates = {}
    for name in policy_names():
        policy, held, hits, total = make_eviction_policy(name), set(), 0, 0
        for keys in trace:
            for key in keys:
                total += 1
                if key in held:
                    hits += 1
                    policy.touch(key)
                    continue
                if len(held) >= capacity_blocks:
                    held.discard(policy.pop_victim(lambda k: False))
                policy.insert(key)
                held.add(key)
        rates[name] = round(hits / total, 4)
    return rates


async def _round_gbps(client: KvStoreClient, size: int, count: int, per_call: int, salt: bytes) -> tuple[float, float]:
    """Put then get ``count`` new blocks of ``size`` bytes; GB/s of each."""
    blocks = make_blocks(size, count, salt)
    batches = [blocks[i : i + per_call] for i in range(0, count, per_call)]
    start = time.perf_counter()
    for batch in batches:
        result = await client.put(batch)
        assert result.stored == len(batch), result
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    got = 0
    for batch in batches:
        got += len(await client.get([b.key for b in batch], "bench"))
    get_s = time.perf_counter() - start
    assert got == count, f"only {got}/{count} blocks came back"
    await client.remove([b.key for b in blocks])
    return size * count / put_s / 1e9, size * count / get_s / 1e9


async def paired_mtls(plain: str, secure: str, tls: PeerTls, size: int, count: int, chunk: int, per_call: int,
                      rounds: int) -> dict:
    """Plaintext and mutual-TLS rounds alternated (AB, BA, AB, ...) against two host-tier nodes
    alike but for TLS; the mTLS/plaintext ratio is taken per pair of adjacent rounds."""
    clients = {False: KvStoreClient(plain, movers=["grpc"], timeout_s=300, max_chunk_bytes=chunk),
               True: KvStoreClient(secure, movers=["grpc"], timeout_s=300, max_chunk_bytes=chunk, tls=tls)}
    gbps: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    put_ratios, get_ratios = [], []
    try:
        for mtls, client in clients.items():  # warm the channels (and the TLS handshake)
            await _round_gbps(client, size, 1, 1, f"warm-{mtls}".encode())
        for r in range(rounds):
            pair = {}
            for mtls in ((False, True) if r % 2 == 0 else (True, False)):
                pair[mtls] = await _round_gbps(clients[mtls], size, count, per_call, f"pair-{size}-{mtls}-{r}".encode())
                gbps[mtls].append(pair[mtls])
            put_ratios.append(pair[True][0] / pair[False][0])
            get_ratios.append(pair[True][1] / pair[False][1])
    finally:
        for client in clients.values():
            await client.close()
    median = statistics.median
    return {"block_mib": size // MIB, "rounds": rounds,
            "plain_put_gbps": round(median(g[0] for g in gbps[False]), 3),
            "plain_get_gbps": round(median(g[1] for g in gbps[False]), 3),
            "mtls_put_gbps": round(median(g[0] for g in gbps[True]), 3),
            "mtls_get_gbps": round(median(g[1] for g in gbps[True]), 3),
            "put_pct_of_plaintext": round(100 * median(put_ratios), 1),
            "get_pct_of_plaintext": round(100 * median(get_ratios), 1),
            "put_pct_range": [round(100 * min(put_ratios), 1), round(100 * max(put_ratios), 1)],
            "get_pct_range": [round(100 * min(get_ratios), 1), round(100 * max(get_ratios), 1)]}


def start_node(config: dict, workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    port, admin = free_port(), free_port()
    config = {**config, "listen": {"host": "127.0.0.1", "port": port, "admin_port": admin}}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    node = start([sys.executable, "-m", "crescent.services.kvstore.server", "--config", str(path)], workdir / f"{name}.log")
    wait_http(f"http://127.0.0.1:{admin}/health")
    return node, f"127.0.0.1:{port}"


def measure_mtls_cost(args: argparse.Namespace, workdir: Path, node_tls: dict, client_tls: PeerTls) -> list[dict]:
    rows = []
    for size_mib in args.sizes_mib:
        size, count = size_mib * MIB, max(2, args.total_mib // size_mib)
        config = tier_config("host", workdir, None, (count + 2) * size * 2, args.chunk_mib * MIB)
        plain, plain_address = start_node(config, workdir, "plain")
        try:
            secure, secure_address = start_node({**config, "tls": node_tls}, workdir, "mtls")
            try:
                row = asyncio.run(paired_mtls(plain_address, secure_address, client_tls, size, count,
                                              args.chunk_mib * MIB, max(1, args.batch_mib // size_mib), args.rounds))
            finally:
                stop(secure)
        finally:
            stop(plain)
        rows.append(row)
        print(f"mTLS vs plaintext gRPC, host {size_mib:3d} MiB: put {row['mtls_put_gbps']:.2f} vs "
              f"{row['plain_put_gbps']:.2f} GB/s = {row['put_pct_of_plaintext']}% {row['put_pct_range']}, get "
              f"{row['mtls_get_gbps']:.2f} vs {row['plain_get_gbps']:.2f} GB/s = {row['get_pct_of_plaintext']}% "
              f"{row['get_pct_range']} (median and range over {row['rounds']} paired rounds)", flush=True)
    return rows


def side_channel_summary(results: list[dict]) -> None:
    """The TCP side channel's share of the same-round memcpy, per block size, plaintext and mTLS
    (issue 16's figure: >= 35% for 4-64 MiB calls)."""
    rows = [r for r in results if r["tier"] == "host" and r["path"].split("+")[0] == "tcp"]
    for row in rows:
        tls = "mTLS" if row["path"].endswith("+mtls") else "plaintext"
        print(f"TCP side channel {row['block_mib']:3d} MiB, {tls:9s}: put {row['put_pct_memcpy']:5.1f}% "
              f"get {row['get_pct_memcpy']:5.1f}% of memcpy (load {row['load_1min']})")


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per case")
    parser.add_argument("--chunk-mib", type=int, default=4, help="gRPC chunk size, both directions")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per case; medians are printed")
    parser.add_argument("--batch-mib", type=int, default=64,
                        help="bytes per put/get call (a prefix of blocks, as prefill reads and writes them); "
                             "0: one block per call")
    parser.add_argument("--tiers", nargs="+", default=["host", "disk", "s3"], choices=["host", "disk", "s3"])
    parser.add_argument("--tls", choices=["off", "on", "both"], default="off",
                        help="gRPC cases plaintext, with mutual TLS, or both (and the cost of mTLS)")
    parser.add_argument("--movers", nargs="+", default=["grpc", "shm", "tcp", "nixl"], choices=list(MOVERS),
                        help="byte movers measured on the host tier")
    parser.add_argument("--handoff", action="store_true", help="also time a prompt's prefill -> decode handoff")
    parser.add_argument("--handoff-tokens", type=int, default=2048)
    parser.add_argument("--huge-pages", choices=["off", "2Mi", "1Gi"], default="off",
                        help="the host pool in huge pages (tiers.host.huge_pages; the machine must have them free): "
                             "run once with and once without to see what they change")
    parser.add_argument("--fresh-connections", action="store_true",
                        help="a new side-channel connection (and TLS handshake) per call, as before clients kept "
                             "them: run once with and once without to see what keeping saves")
    args = parser.parse_args()
    if args.fresh_connections:
        side_channel.MAX_IDLE_PER_PEER = 0  # nothing is kept: every stripe connects anew
    keep_large_buffers_warm()  # as the client process of a real deployment should
    results = []
    # both: every mover plaintext, the side channel (and NIXL) with mTLS too; gRPC's mTLS by paired_mtls
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tls]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        issued = make_pki(workdir / "tls", [("kvstore", "bench-node"), ("prefill", "bench-client")])
        node_tls = issued[("kvstore", "bench-node")].settings()
        client_tls = load_tls(TlsSettings(**issued[("prefill", "bench-client")].settings()))
        s3_proc, s3_endpoint = None, None
        if "s3" in args.tiers:
            port = free_port()
            exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
            s3_proc = start([exe, "-H", "127.0.0.1", "-p", str(port)], workdir / "moto.log")
            s3_endpoint = f"http://127.0.0.1:{port}"
            wait_http(f"{s3_endpoint}/moto-api/")
            global S3_ENDPOINT
            S3_ENDPOINT = s3_endpoint
        try:
            for tier in args.tiers:
                # NIXL gets a node of its own: its agent's progress thread polls, and would slow the others.
                groups = [[m for m in args.movers if m != "nixl"], [m for m in args.movers if m == "nixl"]]
                groups = [g for g in groups if g] if tier == "host" else [["grpc"]]
                for size_mib, mtls, group in [(size, mtls, g) for size in args.sizes_mib for mtls in modes for g in groups]:
                    size = size_mib * MIB
                    count = max(2, args.total_mib // size_mib)
                    port, admin = free_port(), free_port()
                    config = tier_config(tier, workdir, s3_endpoint, (count + 2) * size * 2, args.chunk_mib * MIB)
                    config["listen"] = {"host": "127.0.0.1", "port": port, "admin_port": admin}
                    if tier == "host":
                        config["tiers"]["host"]["huge_pages"] = args.huge_pages
                    if mtls:
                        config["tls"] = node_tls
                    config["nixl"] = group == ["nixl"]  # the node serves it where it can
                    path = workdir / f"{tier}.yaml"
                    path.write_text(yaml.safe_dump(config))
                    node = start([sys.executable, "-m", "crescent.services.kvstore.server", "--config", str(path)],
                                 workdir / f"{tier}.log")
                    try:
                        wait_http(f"http://127.0.0.1:{admin}/health")
                        paths = [m for m in group if not mtls or (m != "shm" and (m != "grpc" or args.tls == "on"))]
                        for mover in paths:
                            per_call = max(1, args.batch_mib // size_mib)
                            load = os.getloadavg()[0]
                            case = asyncio.run(
                                run_case(f"127.0.0.1:{port}", size, count, mover, tier, args.chunk_mib * MIB, per_call,
                                         1 if tier == "s3" else args.rounds, client_tls if mtls else None, node.pid)
                            )
                            put, get = case.put_gbps, case.get_gbps
                            served = case.mover if case.mover == mover else f"{mover}->{case.mover}"  # e.g. nixl->nixl/grpc
                            row = {"tier": tier, "path": served + ("+mtls" if mtls else ""),
                                   "block_mib": size_mib,
                                   "blocks_per_call": per_call, "put_gbps": round(put, 3), "get_gbps": round(get, 3),
                                   "memcpy_gbps": round(case.memcpy_gbps, 3),
                                   "put_pct_memcpy": round(case.put_pct, 1), "get_pct_memcpy": round(case.get_pct, 1),
                                   "client_cpu_s_per_gb": round(case.client_cpu_s_per_gb, 3),
                                   "node_cpu_s_per_gb": None if case.node_cpu_s_per_gb is None
                                   else round(case.node_cpu_s_per_gb, 3), "load_1min": round(load, 2)}
                            raw = ""
                            if tier != "host" and not mtls:
                                raw_put, raw_get = raw_tier_gbps(tier, size, count, workdir)
                                own_put, own_get = asyncio.run(tier_alone_gbps(tier, size, count, workdir))
                                row |= {"raw_put_gbps": round(raw_put, 3), "raw_get_gbps": round(raw_get, 3),
                                        "tier_alone_put_gbps": round(own_put, 3), "tier_alone_get_gbps": round(own_get, 3)}
                                raw = (f"\n{'':24s}tier code alone: put {own_put:5.2f} get {own_get:5.2f} GB/s; "
                                       f"raw {'files' if tier == 'disk' else 'boto3'}: put {raw_put:5.2f} get {raw_get:5.2f} GB/s")
                            results.append(row)
                            print(f"{tier:5s} {row['path']:9s} {size_mib:3d} MiB x{per_call:<3d} put {put:6.2f} GB/s  "
                                  f"get {get:6.2f} GB/s  memcpy {case.memcpy_gbps:6.2f} GB/s  "
                                  f"({row['put_pct_memcpy']}% / {row['get_pct_memcpy']}%)  CPU s/GB client "
                                  f"{row['client_cpu_s_per_gb']} node {row['node_cpu_s_per_gb']}  load {load:.1f}{raw}",
                                  flush=True)
                    finally:
                        stop(node)
                    if tier == "disk":
                        shutil.rmtree(workdir / "disk", ignore_errors=True)
        finally:
            if s3_proc is not None:
                stop(s3_proc)
        tls_cost = (measure_mtls_cost(args, workdir, node_tls, client_tls)
                    if args.tls == "both" and "host" in args.tiers and "grpc" in args.movers else [])
    ceiling: dict[str, float] = {}
    if "host" in args.tiers:  # the gRPC path's yardstick: what loopback itself moves here
        ceiling = transport_ceiling.ceilings(args.chunk_mib * MIB, 512 * MIB)
        copy = Memcpy(args.chunk_mib * MIB, max(2, 128 // args.chunk_mib))
        reference = statistics.median(copy.gbps() for _ in range(5))
        ceiling["memcpy_gbps"] = reference
        print(f"loopback without the kvstore ({args.chunk_mib} MiB messages): "
              f"TCP {ceiling['tcp_loopback_gbps']:.2f} GB/s ({100 * ceiling['tcp_loopback_gbps'] / reference:.0f}% of memcpy), "
              f"two TCP connections {ceiling['tcp_loopback_2_connections_gbps']:.2f} GB/s "
              f"({100 * ceiling['tcp_loopback_2_connections_gbps'] / reference:.0f}%), "
              f"grpcio raw bytes {ceiling['grpcio_raw_gbps']:.2f} GB/s ({100 * ceiling['grpcio_raw_gbps'] / reference:.0f}%)")
        side_channel_summary(results)
    handoff = bench_handoff.measure(args.handoff_tokens) if args.handoff else {}
    rates = policy_hit_rates()
    print("eviction policies, block hit rate on a conversation + scan trace:",
          ", ".join(f"{k} {v:.1%}" for k, v in rates.items()))
    print(json.dumps({"bench": "kvstore", "results": results, "transport_ceiling": ceiling, "policy_hit_rates": rates,
                      "mtls_cost": tls_cost, "handoff": handoff, "cpu": cpu_model()}))


if __name__ == "__main__":
    main()

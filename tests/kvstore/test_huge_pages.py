"""The host pool in huge pages (``tiers.host.huge_pages``): a node that cannot have them stops at
start and says how many it needs; one that can serves same-host clients from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvstore.host_pool import HugePagesUnavailable, HostPool, free_huge_pages

from .helpers import MODEL, make_chain

MIB = 1 << 20
POOL = 16 * MIB  # 8 huge pages of 2 MiB


@pytest.mark.slow
def test_too_few_huge_pages_stop_the_node_at_start_with_what_is_needed(tmp_path: Path) -> None:
    pages = free_huge_pages("2Mi") + 1  # one more than this machine can give
    config = tmp_path / "kvstore.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
        "tiers": {"host": {"capacity_bytes": pages * 2 * MIB, "huge_pages": "2Mi"}},
    }))
    done = subprocess.run([sys.executable, "-m", "crescent.services.cli", "serve", "kvstore", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, said
    assert f"needs {pages} huge pages of 2Mi" in said and "tiers.host.huge_pages=off" in said
    assert "Traceback" not in said


def test_a_pool_in_huge_pages_takes_them_all_at_start_or_none() -> None:
    free = free_huge_pages("2Mi")
    if free < POOL // (2 * MIB):
        with pytest.raises(HugePagesUnavailable):
            HostPool(POOL, 256 * 1024, shared=True, huge_pages="2Mi")
        return
    pool = HostPool(POOL, 256 * 1024, shared=True, huge_pages="2Mi")
    assert free_huge_pages("2Mi") == free - POOL // (2 * MIB)  # reserved when mapped, not at first touch
    start = pool.allocate(3 * MIB)
    pool.view(start, 5)[:] = b"hello"
    assert bytes(pool.view(start, 5)) == b"hello"
    with pytest.raises(ValueError, match="pinned"):
        HostPool(POOL, 256 * 1024, pinned=True, huge_pages="2Mi")


def huge_mappings(pid: int) -> list[str]:
    """The process's mappings whose kernel page size is 2 MiB."""
    found, name = [], ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if not line.split()[0].endswith(":"):  # a mapping's first line: addresses ... path
            name = " ".join(line.split()[5:])
        elif line.startswith("KernelPageSize:") and line.split()[1] == "2048":
            found.append(name)
    return found


async def test_same_host_clients_put_and_get_through_a_huge_page_pool(kvstore_node) -> None:
    if free_huge_pages("2Mi") < POOL // (2 * MIB):
        pytest.skip("no free 2 MiB huge pages here (echo 16 > /proc/sys/vm/nr_hugepages to run this)")
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": POOL, "huge_pages": "2Mi"}}})
    assert any("crescent-kv-pool" in name for name in huge_mappings(node.proc.pid))
    writer = KvStoreClient(node.address, shared_memory=True)
    reader = KvStoreClient(node.address, shared_memory=True)
    try:
        chain = make_chain(4, floats=MIB // 4)
        assert (await writer.put(chain)).stored == 4
        got = await reader.get_prefix([b.key for b in chain], MODEL)
        assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert writer.mover == reader.mover == "shm"
        assert reader.shared_memory._pool_map is not None  # the node's huge-page pool itself, mapped
    finally:
        await writer.close()
        await reader.close()
    assert not writer.errors and not reader.errors

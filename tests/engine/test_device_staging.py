"""A layer leaves the device only once its kernels are done, and the compute never waits for that.

A fake device stands in for a GPU: fences fire in the order they were recorded, one every few
milliseconds, on the device's own thread, long after the engine queued (here: ran) the work
before them; a copy out of the pool waits for the fence it is ordered after, as a copy stream's
``wait_event`` does. The engine prefills a prompt in several chunks while a second thread (the
event loop's role) copies every completed block's layer as its hook fires.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from crescent.services.engine.device_staging import COMPLETE, CudaStreams, DeviceStaging, HostStreams
from crescent.services.engine.engine import Engine
from tests.engine.tiny_model import TINY, tiny_model

PAGE = 16
LAG_S = 0.02  # between two fences firing


class FakeFence:
    def __init__(self, device: FakeDevice, index: int) -> None:
        self.device, self.index = device, index

    def done(self) -> bool:
        return self.device.fired > self.index


class FakeDevice:
    """Fences fire in order, one every ``LAG_S``, on this device's thread."""

    def __init__(self) -> None:
        self.recorded = 0
        self.fired = 0
        self.reads: list[tuple[int, bool]] = []  # (fence index, fired when read)
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self.recorded > self.fired)
                if self._stop:
                    return
            time.sleep(LAG_S)
            with self._cv:
                self.fired += 1
                self._cv.notify_all()

    def record(self) -> FakeFence:
        with self._cv:
            fence = FakeFence(self, self.recorded)
            self.recorded += 1
            self._cv.notify_all()
            return fence

    def copy(self, after: FakeFence, src: torch.Tensor, out: torch.Tensor) -> None:
        with self._cv:  # the copy stream waits for the fence; the copying thread for the copy
            self._cv.wait_for(after.done)
            self.reads.append((after.index, after.done()))
        out.copy_(src)

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()


def test_a_layer_is_copied_only_after_its_fence_and_the_forward_never_waits() -> None:
    torch.set_num_threads(1)
    engine = Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=16 * PAGE, block_size=PAGE,
                    prefill_chunk_tokens=PAGE)  # one forward per block: 4 forwards of 2 layers
    device = FakeDevice()
    cache = engine.cache
    cache.staging = DeviceStaging(TINY.num_layers, device)
    tokens = torch.randint(2, TINY.vocab_size, (4 * PAGE + 5,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = engine.add_sequence("a", tokens)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    copies: dict[tuple[int, int], torch.Tensor] = {}
    hook_fences: list[tuple[int, object]] = []
    done_blocks = 0

    def on_layer(layer: int, end: int) -> None:  # the engine thread: queue copies, never wait
        nonlocal done_blocks
        hook_fences.append((layer, cache.staging.fence(layer)))
        for block in range(done_blocks, end // PAGE):
            jobs.put((block, layer))
        if layer == TINY.num_layers - 1:
            done_blocks = end // PAGE

    def copier() -> None:  # the event loop's role
        while (job := jobs.get()) is not None:
            block, layer = job
            out = bytearray(2 * PAGE * TINY.num_kv_heads * TINY.head_dim * 4)
            cache.copy_layer(seq.pages[block], layer, PAGE, memoryview(out))
            copies[job] = torch.frombuffer(out, dtype=torch.float32).clone()

    thread = threading.Thread(target=copier)
    thread.start()
    try:
        engine.prefill(seq, on_layer)
        computed_at_fired = device.fired  # the forward returned long before its fences fired
        jobs.put(None)
        thread.join()
    finally:
        device.stop()
    forwards = 5  # 4 full blocks and the last 5 tokens
    assert device.recorded == forwards * TINY.num_layers
    assert computed_at_fired < device.recorded // 2, "the compute thread waited for the device"
    # each hook saw a fence recorded for its own layer in its own forward, in order
    assert [layer for layer, _ in hook_fences] == [0, 1] * forwards
    assert [fence.index for _, fence in hook_fences] == list(range(forwards * TINY.num_layers))
    assert all(fired for _, fired in device.reads) and len(device.reads) == len(copies) == 4 * TINY.num_layers
    for (block, layer), got in copies.items():  # and the bytes are the final layer's
        assert torch.equal(got, cache.pool[seq.pages[block], layer].flatten()), (block, layer)


def test_the_cpu_copies_as_it_always_did() -> None:
    staging = DeviceStaging(2, HostStreams())
    staging.record(1)
    assert staging.fence(0) is COMPLETE and staging.fence(1).done()
    src, out = torch.randn(2, 3, 4), torch.empty(2, 3, 4)
    staging.copy_out(1, src, out)
    assert torch.equal(src, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the real copy stream has not run")
def test_on_cuda_a_layer_copied_after_a_long_queued_kernel_gives_its_final_bytes() -> None:
    """The real thing the fake device above stands in for: a layer's write queued behind ~0.1 s of
    GPU work, its event recorded without the host waiting, and the copy stream's copy of the
    (strided) layer view gives the layer's final bytes, not what the pool held when it was queued."""
    dev = torch.device("cuda")
    pool = torch.zeros(6, 2, 2, PAGE, 3, 64, dtype=torch.bfloat16, device=dev)  # (pages, layers, K/V, ...)
    final = torch.randn(6, 2, PAGE, 3, 64).to(torch.bfloat16)
    final_on_device = final.to(dev)
    torch.cuda.synchronize()
    staging = DeviceStaging(2, CudaStreams(dev))
    torch.cuda._sleep(200_000_000)  # a long kernel queued ahead of the layer's write (~0.1 s at 2 GHz)
    pool[:, 1].copy_(final_on_device)
    staging.record(1)
    assert not staging.fence(1).done()  # the host queued the layer and went on
    out = torch.empty_like(final)
    staging.copy_out(1, pool[:, 1], out)
    assert torch.equal(out, final)
    assert staging.fence(1).done()

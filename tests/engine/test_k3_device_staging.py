"""Kimi K3's cache leaves the device in order too: an MLA layer's latents are copied only after
that layer's kernels are done, a KDA state only after the device-side clone the hook queued, and
the compute thread never waits for either.

The fake device of ``test_device_staging.py`` stands in for a GPU (fences fire late, in order, on
its own thread; a copy waits for the fence it is ordered after). The engine prefills a prompt in
several chunks while a second thread (the event loop's role) copies what each hook made final,
as both layer-wise exporters do. No fence fires until the forward has returned: had the compute
thread waited for one (a host sync inside the layer loop), it would never have returned.
"""

from __future__ import annotations

import queue
import threading

import torch

from crescent.services.engine.device_staging import DeviceStaging, HostStreams
from tests.engine.test_device_staging import FakeDevice
from tests.engine.test_kimi_k3_snapshots import PAGE, TEST_CFG, make_engine, prompt

MLA, KDA = TEST_CFG.mla_layers, TEST_CFG.kda_layers  # model layers; MLA wire layer m is MLA[m]
LAYERS = TEST_CFG.num_layers


class GatedDevice(FakeDevice):
    """No fence fires before ``open()``: a compute thread that waited for one would never return."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        super().__init__()

    def _run(self) -> None:
        self.gate.wait()
        super()._run()

    def stop(self) -> None:
        self.gate.set()
        super().stop()


def test_k3_latents_and_states_are_copied_after_their_fences_and_the_forward_never_waits() -> None:
    engine = make_engine(every=2, chunk=PAGE)  # one forward per block; snapshots every 2nd block
    cache = engine.cache
    device = GatedDevice()
    cache.staging = DeviceStaging(LAYERS, device)
    tokens = prompt(4 * PAGE + 5)
    seq = engine.add_sequence("a", tokens)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    copies: dict[object, torch.Tensor] = {}
    order: list[object] = []  # the copies in the order the copier took them
    waited_on: dict[object, int] = {}  # job -> the fence index the hook handed it
    hooks: list[tuple[int, int, int]] = []  # (model layer, its latest fence's index, fences recorded) at the hook
    done_blocks = 0

    def on_layer(layer: int, end: int) -> None:  # the engine thread: queue copies, never wait
        nonlocal done_blocks
        fence = cache.staging.fence(layer)
        hooks.append((layer, fence.index, device.recorded))
        if layer in MLA:
            m = MLA.index(layer)
            for block in range(done_blocks, end // PAGE):
                waited_on[(block, m)] = fence.index
                jobs.put(((block, m), None))
        if layer == KDA[-1] and end == len(tokens):  # the states are final: clone them now
            staged = {"live": cache.stage_live_state(seq.state)}
            staged |= {("snap", i): cache.stage_snapshot(p) for i, p in enumerate(seq.pages) if cache.has_snapshot(p)}
            for key, s in staged.items():
                waited_on[key] = s.fence.index
                jobs.put((key, s))
        if layer == LAYERS - 1:
            done_blocks = end // PAGE

    def copier() -> None:  # the event loop's role
        while (job := jobs.get()) is not None:
            key, staged = job
            order.append(key)
            if staged is None:
                block, m = key
                out = bytearray(PAGE * TEST_CFG.mla_latent_dim * cache.dtype.itemsize)
                cache.copy_layer(seq.pages[block], m, PAGE, memoryview(out))
                copies[key] = torch.frombuffer(out, dtype=cache.dtype).clone()
            else:
                out = bytearray(staged.tensor.numel() * 4)
                staged.copy_into(memoryview(out))
                copies[key] = torch.frombuffer(out, dtype=torch.float32).clone()

    thread = threading.Thread(target=copier)
    thread.start()
    try:
        compute = threading.Thread(target=engine.prefill, args=(seq, on_layer))
        compute.start()
        compute.join(timeout=300)
        assert not compute.is_alive(), "the compute thread waited for the device"
        assert device.fired == 0 and not copies  # every copy still waits, the forward is done
        device.gate.set()
        jobs.put(None)
        thread.join()
    finally:
        device.stop()
    forwards = 5  # 4 full blocks and the last 5 tokens
    snapshots = sum(1 for k in copies if isinstance(k, tuple) and k[0] == "snap")
    assert snapshots == 2  # blocks 2 and 4 (every 2nd, and the prompt's last full block)
    recorded = device.recorded
    assert recorded == forwards * LAYERS + 1 + snapshots  # a fence per layer per forward, one per staged state
    # each hook ran right after its own layer's fence was recorded (the latest), in order
    assert [layer for layer, _, _ in hooks] == list(range(LAYERS)) * forwards
    assert all(index == recorded_then - 1 for _, index, recorded_then in hooks)
    # every copy waited for (and found fired) a fence of its own layer, no older than the one its
    # hook saw (a later forward's fence of that layer covers it: stream order); a staged state
    # waited for the very fence recorded after its clone
    layer_of = {index: layer for layer, index, _ in hooks}
    assert len(order) == len(device.reads)
    for key, (index, _) in zip(order, device.reads):
        if isinstance(key, tuple) and key[0] != "snap":
            assert layer_of[index] == MLA[key[1]] and index >= waited_on[key], (key, index)
        else:
            assert index == waited_on[key], (key, index)
    assert all(fired for _, fired in device.reads) and len(device.reads) == len(copies) == 4 * len(MLA) + 1 + snapshots
    # and the bytes are the final ones: each MLA layer's latents, the live state, each snapshot
    for key, got in copies.items():
        if key == "live":
            want = cache.live(seq.state).read(0)
        elif key[0] == "snap":
            want = cache.snapshots.states.read(cache.snapshots.slot(seq.pages[key[1]]))
        else:
            block, m = key
            want = cache.latent[m, seq.pages[block]].flatten()
        assert torch.equal(got, want), key
    engine.release(seq)


def test_a_staged_state_keeps_the_bytes_of_its_hook_when_the_next_forward_moves_on() -> None:
    """The exporters copy a staged state after the hook, when the engine may be running the
    sequence's next forward: the clone, not the live state, is what they copy."""
    engine = make_engine()
    seq = engine.add_sequence("a", prompt(2 * PAGE + 3))
    first = int(torch.argmax(engine.prefill(seq)[0]))
    at_hook = engine.cache.live(seq.state).read(0)
    staged = engine.cache.stage_live_state(seq.state)
    seq.token_ids.append(first)
    engine.decode_step([seq])  # the live state moves on
    assert not torch.equal(engine.cache.live(seq.state).read(0), at_hook)
    out = bytearray(staged.tensor.numel() * 4)
    staged.copy_into(memoryview(out))
    assert torch.equal(torch.frombuffer(out, dtype=torch.float32), at_hook)
    engine.release(seq)


def test_the_k3_cache_stages_through_the_host_streams_on_the_cpu() -> None:
    cache = make_engine().cache
    assert isinstance(cache.staging.streams, HostStreams)

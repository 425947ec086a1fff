"""The native engine's CUDA code path, run on this CPU (no GPU here).

``crescent.kernels.cpu.ops._on_gpu`` is the one place that decides whether a tensor goes to the
Triton kernels (the invariant linear and RMSNorm); patched to say "GPU", CPU tensors take that
path and the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) runs the kernels.
With the attention seam handing out ``TritonAttention`` over ``crescent.kernels.paged`` as it does
for a CUDA cache, the whole Llama forward is the one a GPU would run, kernel for kernel. What this
cannot show: the kernels' speed, TF32 dots (the interpreter computes in numpy), and anything about
streams or host syncs (the meta-device test below covers the latter).
"""

from __future__ import annotations

import types

import pytest
import torch

import crescent.services.engine.llama as llama
from crescent.kernels.cpu import ops as cpu_ops
from crescent.services.engine import attention as attention_mod
from crescent.services.engine.attention import TritonAttention
from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from tests.engine.tiny_model import TINY, dense_logits, tiny_weights

pytestmark = [
    pytest.mark.skipif(attention_mod.triton_paged_attention() is None, reason="Triton is not installed"),
    # CPU tensors through the Triton kernels: the interpreter only (on a GPU, test_device.py's [cuda] cases)
    pytest.mark.skipif(torch.cuda.is_available(), reason="runs the CUDA code path under the Triton interpreter"),
]

PAGE = 16


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(2, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def cuda_path(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every tensor claimed by the Triton kernels, attention on crescent.kernels.paged; counts the
    kernel calls so a test can tell the path really ran."""
    calls = {"invariant_linear": 0, "invariant_rms_norm": 0}
    real = cpu_ops._triton_ops()

    def counted(name: str):  # noqa: ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return getattr(real, name)(*args, **kwargs)
        return call

    spy = types.SimpleNamespace(**{name: counted(name) for name in calls})
    monkeypatch.setattr(cpu_ops, "_on_gpu", lambda t: True)
    monkeypatch.setattr(cpu_ops, "_triton_ops", lambda: spy)
    monkeypatch.setattr(llama, "attention_for",
                        lambda *a, scale, **k: TritonAttention(scale, attention_mod.triton_paged_attention()))
    return calls


def engine_in(dtype: torch.dtype) -> Engine:
    torch.set_num_threads(1)
    weights = {n: t.to(dtype) for n, t in tiny_weights().items()}  # a checkpoint stored in `dtype`
    model = LlamaModel(TINY, weights, device="cpu", dtype=dtype)
    return Engine(model, model_id="tiny", kv_capacity_tokens=48 * PAGE, block_size=PAGE)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_the_whole_forward_on_the_cuda_path_matches_the_dense_reference(cuda_path, dtype, tol) -> None:  # noqa: ANN001
    """Prefill, then decode steps, every linear, norm and attention on the Triton kernels, against
    the textbook float32 forward (the tolerances of tests/engine/test_device.py: float32 to
    rounding, bf16 to its 8-bit mantissa)."""
    engine = engine_in(dtype)
    model = engine.model
    assert model.layers[0].qkv.weight.dtype == dtype  # the GPU path keeps the weight's dtype
    tokens = prompt(45)
    reference = dense_logits(TINY, tiny_weights(), tokens)
    seq = engine.add_sequence("a", tokens[:40])
    assert rel_err(engine.prefill(seq), reference[39]) < tol
    assert model.attention_path(engine.cache).name == "triton"
    # per layer: qkv, o, gate_up, down and two norms; then the final norm and lm_head
    assert cuda_path == {"invariant_linear": 4 * TINY.num_layers + 1, "invariant_rms_norm": 2 * TINY.num_layers + 1}
    for i in range(40, 45):
        seq.token_ids.append(tokens[i])
        assert rel_err(engine.decode_step([seq])[0], reference[i]) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # 3-6 s each here
def test_a_decode_row_has_the_same_bits_alone_and_in_a_batch_of_8(cuda_path, dtype) -> None:  # noqa: ANN001
    """Issue 30 item 3, "batch 1 and batch 8 give the same bits on the GPU too", on the kernels a
    GPU runs: 8 prompts prefilled in one forward, then one decode step of all 8; rows 2 and 7
    equal, bit for bit, the same rows computed alone (each prompt prefilled by itself, each
    decode step a batch of 1) in another engine, where their pages lie elsewhere."""
    engine = engine_in(dtype)
    seqs = [engine.add_sequence(f"s{i}", prompt(3 + 2 * i, seed=i)) for i in range(8)]  # 3..17 tokens: the last over a page
    firsts, _ = engine.mixed_step([(s, s.num_tokens) for s in seqs], [])
    for seq, logits in zip(seqs, firsts, strict=True):
        seq.token_ids.append(int(logits.argmax()))
    batched = engine.decode_step(seqs)
    assert batched.shape[0] == 8
    alone_engine = engine_in(dtype)
    alone = {i: alone_engine.add_sequence(f"x{i}", seqs[i].token_ids[:-1]) for i in (7, 2)}  # other pages
    for i, seq in alone.items():
        assert torch.equal(alone_engine.prefill(seq), firsts[i]), f"prefill of prompt {i}"
        seq.token_ids.append(seqs[i].token_ids[-1])
    for i, seq in alone.items():
        assert torch.equal(alone_engine.decode_step([seq])[0], batched[i]), f"decode row {i}"


# ---- what the CUDA attention kernels cannot take ---------------------------------------------------------


def test_a_block_size_the_cuda_kernels_cannot_take_is_refused_at_start_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """Before the model loads (an empty .gguf is never read), not at the first forward."""
    import crescent.services.instance.runtime as runtime
    from crescent.services.engine.device import DeviceSettingError
    from crescent.services.engine.loader.errors import ModelLoadError
    from crescent.services.engine.settings import EngineSettings

    monkeypatch.setattr(runtime, "resolve_device", lambda name: torch.device("cuda"))  # as on a GPU node
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    with pytest.raises(DeviceSettingError, match=r"engine\.block_size 24 on engine\.device 'cuda'.*multiple of 16"):
        runtime.build_engine(EngineSettings(device="cuda", model=str(model), block_size=24), progress=False)
    # a fitting block size gets past the check to the loader (which then fails on the empty file)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        runtime.build_engine(EngineSettings(device="cuda", model=str(model), block_size=48), progress=False)


def test_a_head_dim_over_256_takes_the_torch_path_on_cuda_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    cuda = torch.device("cuda")
    with caplog.at_level("WARNING"):
        path = attention_mod.attention_for(cuda, torch.bfloat16, torch.bfloat16, head_dim=320, group=2, scale=0.1)
    assert path.name == "torch" and "head dim 320 is over the Triton kernels' 256" in caplog.text
    assert attention_mod.attention_for(cuda, torch.bfloat16, torch.bfloat16, head_dim=256, group=2,
                                       scale=0.1).name == "triton"


# ---- no host sync on the Triton path ------------------------------------------------------------------


class ShapeOnlyPagedKernels:
    """``crescent.kernels.paged``'s entry points as outputs of the right shape on q's device (as
    tests/engine/test_kimi_k3_device_path.py's ``ShapeOnlyKernels`` does for K3); records which ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def paged_decode_attention(self, q, k_pool, v_pool, block_tables, seq_lens, *, scale):  # noqa: ANN001
        self.calls.append(("decode", q.shape[0]))
        return torch.empty_like(q)

    def paged_prefill_attention(self, q, k_pool, v_pool, block_tables, seq_lens, cu_q, *, scale):  # noqa: ANN001
        self.calls.append(("prefill", q.shape[0]))
        return torch.empty_like(q)


def test_the_triton_path_on_the_meta_device_mixes_no_host_tensor_and_reads_nothing_back(monkeypatch) -> None:  # noqa: ANN001
    """The Llama forward as a GPU runs it (Triton linear, RMSNorm and paged attention, each kernel
    replaced by a shape-only stand-in) on ``meta`` tensors, which hold no values: a ``.item()``,
    ``.tolist()``, ``.cpu()`` or a Python branch on a device tensor anywhere in the path raises, and
    so does a CPU tensor mixed into device compute (the attention seam's tables, lengths, rows)."""
    from crescent.services.engine.kv_cache import PagedKvCache
    from crescent.services.engine.llama import ForwardBatch, SeqChunk

    kernels = ShapeOnlyPagedKernels()
    dense = types.SimpleNamespace(
        invariant_linear=lambda x, w: x.new_empty((x.shape[0], w.shape[0])),
        invariant_rms_norm=lambda x, w, eps: torch.empty_like(x))
    monkeypatch.setattr(cpu_ops, "_on_gpu", lambda t: True)
    monkeypatch.setattr(cpu_ops, "_triton_ops", lambda: dense)
    monkeypatch.setattr(llama, "attention_for", lambda *a, scale, **k: TritonAttention(scale, kernels))
    model = LlamaModel(TINY, tiny_weights(), device="meta", dtype=torch.bfloat16)
    cache = PagedKvCache(8, TINY.num_layers, PAGE, TINY.num_kv_heads, TINY.head_dim, dtype=torch.bfloat16,
                         device="meta")
    chunks = [(SeqChunk((0, 1), 20, 20), prompt(20)), (SeqChunk((2,), 9, 1), [5]),  # a prompt, a decode row,
              (SeqChunk((3, 4), 30, 10), prompt(10)), (SeqChunk((5,), 3, 1), [7])]  # a chunk after a prefix
    hooks: list[int] = []
    logits = model.forward(ForwardBatch.build(chunks, PAGE), cache, [0, 1, 2, 3], on_layer=hooks.append)
    assert logits.device.type == "meta" and tuple(logits.shape) == (4, TINY.vocab_size)
    assert model.attention_path(cache).name == "triton" and hooks == list(range(TINY.num_layers))
    assert kernels.calls == [("decode", 2), ("prefill", 30)] * TINY.num_layers  # rows gathered and scattered


# ---- which caches take the kvstore's device path ------------------------------------------------------


def test_a_llama_pool_and_a_kimi_k3_cache_on_cuda_take_the_device_block_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DeviceBlocks.for_cache``: a Llama ``PagedKvCache`` and a kimi_k3 cache on CUDA get the
    device path (blocks gathered into device rooms for the kvstore's GPU tier); on the CPU neither
    does. A kimi_k3 block carries a KDA state or not: its first room is a block without a state,
    and one with a state is got again into a room of its own size (``device_store.py``). Here the
    caches' device says "cuda"; nothing is allocated on it."""
    from crescent.services.engine.device_blocks import CudaRooms, DeviceBlocks
    from crescent.services.engine.kimi_k3.model import K3Model
    from crescent.services.engine.kimi_k3.ops import OpsBackend
    from crescent.services.engine.kv_cache import PagedKvCache
    from tests.engine.k3_reference import TEST_CFG
    from tests.engine.test_kimi_k3_device_path import _weights

    cuda = torch.device("cuda")
    llama_cache = PagedKvCache(4, TINY.num_layers, PAGE, TINY.num_kv_heads, TINY.head_dim, dtype=torch.bfloat16)
    k3_cache = K3Model(TEST_CFG, _weights(False), backend=OpsBackend.REFERENCE).make_cache(4, PAGE)
    assert DeviceBlocks.for_cache(llama_cache) is None and DeviceBlocks.for_cache(k3_cache) is None  # on the CPU

    k3_cache.device = cuda
    k3_blocks = DeviceBlocks.for_cache(k3_cache)
    assert isinstance(k3_blocks, DeviceBlocks) and k3_blocks.cache is k3_cache and k3_blocks.stateful
    assert isinstance(k3_blocks._rooms, CudaRooms) and k3_blocks._rooms.device == cuda
    # a first room holds a block without a state: its latents, every MLA layer, in the cache dtype
    assert k3_blocks.block_bytes == PAGE * len(TEST_CFG.mla_layers) * TEST_CFG.mla_latent_dim * k3_cache.dtype.itemsize
    monkeypatch.setattr(PagedKvCache, "device", property(lambda self: cuda))
    blocks = DeviceBlocks.for_cache(llama_cache)
    assert isinstance(blocks, DeviceBlocks) and blocks.cache is llama_cache and not blocks.stateful
    assert isinstance(blocks._rooms, CudaRooms) and blocks._rooms.device == cuda
    # a room holds one page: (layers, 2, block size, kv heads, head dim) in the pool's dtype
    assert blocks.block_bytes == TINY.num_layers * 2 * PAGE * TINY.num_kv_heads * TINY.head_dim * 2

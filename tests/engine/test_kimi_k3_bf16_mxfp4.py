"""K3 as it serves on a GPU, on this CPU's reference ops: bf16 compute with the routed experts
kept packed as MXFP4 (4.25 bits per weight), against the same model with the experts dequantized
at load. (test_kimi_k3_mxfp4_packed.py checks the pair in fp32; test_kimi_k3_device_path.py runs
the Triton kernels in fp32 only, as the interpreter cannot do bf16 math.)"""

from __future__ import annotations

import torch

from crescent.kernels.mxfp4 import Mxfp4Tensor
from crescent.services.engine.kimi_k3.ffn import LatentMoe
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.engine.kimi_k3.ops import OpsBackend
from tests.engine.test_kimi_k3_device_path import PAGE, _cfg, _prompt, _run, _weights
from crescent.services.engine.engine import Engine


def _engine(weights: dict) -> Engine:
    torch.set_num_threads(1)
    model = K3Model(_cfg(), weights, backend=OpsBackend.REFERENCE, dtype=torch.bfloat16)
    return Engine(model, model_id="k3-bf16", kv_capacity_tokens=64 * PAGE, block_size=PAGE)


def _experts(engine: Engine) -> list:
    return [w for f in engine.model.ffn if isinstance(f, LatentMoe) for w in f.experts]


def test_bf16_packed_experts_give_the_bits_of_bf16_dequantized_experts() -> None:
    """Tolerance: none, bit for bit. An MXFP4 weight is a 2-bit-mantissa code times a power of two,
    exact in bf16 (8-bit mantissa, fp32's exponent range), so dequantizing at load and rounding to
    bf16 and decoding one expert per call in the same bf16 matmul are the same weights and the
    same ops. Two sequences, one over a block boundary, then batched decode steps."""
    packed = _weights(True)
    dequantized = {k: v.dequantize() if isinstance(v, Mxfp4Tensor) else v for k, v in packed.items()}
    a, b = _engine(packed), _engine(dequantized)
    assert _experts(a) and all(isinstance(w, Mxfp4Tensor) for w in _experts(a))  # 4.25 bits resident in bf16 too
    assert all(w.dtype == torch.bfloat16 for w in _experts(b))
    prompts = [_prompt(19, 1), _prompt(6, 2)]
    rows_a, tokens_a = _run(a, prompts, steps=2)
    rows_b, tokens_b = _run(b, prompts, steps=2)
    assert tokens_a == tokens_b
    for got, want in zip(rows_a, rows_b, strict=True):
        assert torch.equal(got, want)

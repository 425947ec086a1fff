"""Cost-model presets: from settings, and Mooncake's paper setting for simulation.

The paper preset models LLaMA3-70B on one 8xA800 node per instance. Prefill FLOPs follow
``flops(n) = l·(a·n²·d + b·n·d²)``, run at a stated MFU. With c tokens cached and u new ones the
new tokens cost ``l·(2a·d·(u·c + u²/2) + b·u·d²)``: the attention term counts the query-key
pairs the new tokens see, and reduces to the paper's ``a·n²·d`` when nothing is cached.
"""

from __future__ import annotations

from dataclasses import dataclass

from crescent.services.scheduler.config import CostSettings
from crescent.services.scheduler.cost_model import (
    CostModels, DecodeCostModel, MixedStepCostModel, PrefillCostModel, TransferCostModel,
)
from crescent.services.scheduler.datatypes import Tier

GB = 1e9


@dataclass(frozen=True, slots=True)
class PaperSetting:
    """LLaMA3-70B on 8xA800 (stated figures; change them to model another setting)."""

    layers: int = 80
    hidden: int = 8192
    a: float = 2.0                   # attention: QKᵀ and AV at 2 FLOPs per multiply-add, halved (causal)
    b: float = 26.0                  # weights: 2·params/(l·d²) ≈ 2·70e9/(80·8192²)
    gpus: int = 8
    peak_flops_per_gpu: float = 312e12  # A800 dense bf16
    mfu: float = 0.45                # stated model FLOPs utilisation during prefill
    weight_bytes: float = 140e9      # bf16 weights, read once per decode step
    hbm_bytes_per_s_per_gpu: float = 2.0e12
    mbu: float = 0.6                 # stated memory-bandwidth utilisation during decode
    kv_bytes_per_token: int = 327_680  # 80 layers · 2 · 8 KV heads · 128 · 2 bytes
    rdma_bytes_per_s: float = 100 * GB   # 8 x 200 Gb/s NICs, effective
    dram_bytes_per_s: float = 100 * GB
    ssd_bytes_per_s: float = 20 * GB
    s3_bytes_per_s: float = 2 * GB
    per_sequence_s: float = 1e-4     # sampling and scheduling per sequence per step
    fixed_prefill_s: float = 0.005


def paper_cost_models(setting: PaperSetting = PaperSetting()) -> CostModels:
    flops_per_s = setting.gpus * setting.peak_flops_per_gpu * setting.mfu
    per_token = setting.layers * setting.b * setting.hidden**2 / flops_per_s
    attention = 2 * setting.layers * setting.a * setting.hidden / flops_per_s  # per query-key pair
    hbm = setting.gpus * setting.hbm_bytes_per_s_per_gpu * setting.mbu
    return CostModels(
        prefill=PrefillCostModel(fixed_s=setting.fixed_prefill_s, per_token_s=per_token, attention_s=attention),
        decode=DecodeCostModel(
            fixed_s=setting.weight_bytes / hbm,
            per_sequence_s=setting.per_sequence_s,
            per_context_token_s=setting.kv_bytes_per_token / hbm,
        ),
        transfer=TransferCostModel(
            kv_bytes_per_token=setting.kv_bytes_per_token,
            latency_s=0.001,
            bytes_per_s={
                Tier.ENGINE: setting.rdma_bytes_per_s,
                Tier.GPU: setting.rdma_bytes_per_s,
                Tier.HOST: setting.dram_bytes_per_s,
                Tier.DISK: setting.ssd_bytes_per_s,
                Tier.S3: setting.s3_bytes_per_s,
            },
        ),
    )


def cost_models_from_settings(settings: CostSettings) -> CostModels:
    if settings.preset == "paper":
        return paper_cost_models()
    p, d, t, m, b = settings.prefill, settings.decode, settings.transfer, settings.mixed, settings.prefill_beside_decode
    mixed = None if m is None else MixedStepCostModel(
        m.fixed_s, m.per_prompt_token_s, m.attention_s, m.per_sequence_s, m.per_context_token_s)
    return CostModels(
        prefill=PrefillCostModel(fixed_s=p.fixed_s, per_token_s=p.per_token_s, attention_s=p.attention_s),
        decode=DecodeCostModel(fixed_s=d.fixed_s, per_sequence_s=d.per_sequence_s, per_context_token_s=d.per_context_token_s),
        transfer=TransferCostModel(
            kv_bytes_per_token=t.kv_bytes_per_token,
            latency_s=t.latency_s,
            bytes_per_s={
                Tier.ENGINE: t.engine_gbps * GB,
                Tier.GPU: t.gpu_gbps * GB,
                Tier.HOST: t.host_gbps * GB,
                Tier.DISK: t.disk_gbps * GB,
                Tier.S3: t.s3_gbps * GB,
            },
        ),
        mixed=mixed,
        prefill_beside_decode=None if b is None else PrefillCostModel(b.fixed_s, b.per_token_s, b.attention_s),
    )

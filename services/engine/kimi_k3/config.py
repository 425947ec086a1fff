"""The shape of a Kimi K3-class hybrid model: which layers are KDA and which gated MLA, the
dense first layer(s), the latent MoE, Block Attention Residuals, the activation — and every
numerical choice the public checkpoints differ in (NoPE or RoPE MLA, the KDA decay-gate form,
a full-rank or low-rank KDA output gate, AttnRes on or off, SiLU or SiTU, the latent norm...).

One frozen dataclass. Crescent's own flat ``config.json`` (``model_type: "kimi_k3"``, no
``text_config``) maps onto it field by field (``from_hf_dict``/``to_hf_dict``); the real Moonshot
formats (``kimi_linear`` and the nested ``kimi_k3``) are translated by ``hf_formats.py``.
``K3_FULL`` is the published K3 shape in Crescent's format (sizes the issue lists; see
docs/k3.md); ``NANO`` is the tiny test model behind the ``kimi-k3-nano`` preset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crescent.services.engine.model_config import ModelConfigError
from crescent.services.model.hf_config import GENERIC_FIELDS, LENGTH_KEYS, HfConfigError, check_generic, context_window

MODEL_TYPE = "kimi_k3"
# torch dtype names a cache may hold latents in; conv tails take the same one, except under fp8
# (``float8_e4m3fn``, EngineSettings.kv_cache_dtype "fp8"), which applies to the MLA latents only
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what a checkpoint's config may state as its dtype
CACHE_DTYPES = (*MODEL_DTYPES, "float8_e4m3fn")
FP8_CACHE = "float8_e4m3fn"
KIMI_VOCAB_SIZE = 163840  # the Kimi tiktoken tokenizer's id space (regular + special tokens)
# The prefix cache's KDA state snapshots by default (SnapshotPolicy, EngineSettings.state_snapshot_*):
# sparse — a snapshot every 16th block (1,024 tokens at 64-token blocks) and at every turn end, ~3
# per conversation turn — in a pool of a few slots (16: about five conversations' worth; 7.2 GB for
# the full K3, whose snapshot is 449 MB — `crescent plan` sizes it for a deployment). docs/k3.md,
# "Which snapshots to keep", measures the trade-off (loadtest/bench_k3_snapshot_ttft.py).
DEFAULT_SNAPSHOT_EVERY_BLOCKS = 16
DEFAULT_SNAPSHOT_SLOTS = 16


@dataclass(frozen=True, slots=True)
class K3Config:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # "kda" or "mla", one per layer
    first_dense_layers: int       # leading layers with a dense SiTU-GLU FFN instead of MoE
    dense_intermediate_size: int
    # Kimi Delta Attention
    kda_num_heads: int            # q/k heads (H)
    kda_num_v_heads: int          # value heads (HV, a multiple of H)
    kda_head_dim: int             # K
    kda_v_head_dim: int           # V
    kda_gate_rank: int            # rank of the low-rank gate projections f (decay) and output gate
    kda_conv_width: int
    kda_lower_bound: float | None  # K3's decay lb·sigmoid(...); None: Kimi-Linear's -exp(A_log)·softplus(...)
    # gated MLA
    mla_num_heads: int
    q_lora_rank: int              # 0: a direct q projection
    kv_lora_rank: int             # Dc, the cached latent
    qk_nope_head_dim: int
    qk_rope_head_dim: int         # Dr, the cached decoupled RoPE key
    v_head_dim: int
    rope_theta: float
    # latent MoE
    num_experts: int
    num_shared_experts: int
    num_experts_per_tok: int
    moe_latent_size: int          # routed experts run in this down-projected space
    moe_intermediate_size: int
    shared_intermediate_size: int
    routed_scaling_factor: float
    # Block Attention Residuals: the 2 * layers sublayers form this many blocks (the last may be
    # short), unless attn_res_block_layers gives the block size in layers (the real configs)
    attn_res_blocks: int
    situ_beta_gate: float
    situ_beta_up: float | None    # None: SiTU leaves the up projection unbounded
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # ---- numerics the checkpoint's config chooses (the defaults are Crescent's own format) ----
    hidden_act: str = "situ"                # "situ" (SiTU-GLU) or "silu" (SwiGLU), every MLP
    mla_rope: bool = True                   # False: NoPE, the "rope" part of q and k stays unrotated
    mla_output_gate: bool = True            # sigmoid(g_proj(x)) on the head outputs
    mla_norm_eps: float | None = None       # q_a/kv_a latent norms; None: rms_norm_eps
    kda_full_rank_output_gate: bool = False  # one g_proj [V, D] instead of g_a_proj/g_b_proj
    attn_res: bool = True                   # False: a plain residual stream (Kimi-Linear)
    attn_res_block_layers: int = 0          # > 0: AttnRes blocks of this many layers (the real configs)
    moe_latent_norm: bool = False           # RMSNorm on the routed latent before latent_up
    moe_scoring: str = "sigmoid"            # router scores: "sigmoid" or "softmax"
    moe_renormalize: bool = True            # chosen scores renormalised to sum 1 (before the scale)
    moe_num_groups: int = 1                 # grouped top-k (DeepSeek-V3 noaux_tc): expert groups
    moe_topk_groups: int = 1                # ... of which each token may use this many
    moe_layer_freq: int = 1                 # MoE on layers i >= first_dense_layers with i % freq == 0
    # dtype the cache stores MLA latents and snapshot conv tails in (KDA states are always fp32;
    # compute stays fp32, upcasting on read): the model's dtype. Real checkpoints take their
    # torch_dtype (bf16), K3_FULL says bfloat16; Crescent's presets keep the fp32 default.
    # EngineSettings.kv_cache_dtype overrides it.
    cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in ("kda", "mla")]
        if bad or not self.layer_types:
            raise ModelConfigError(f"layer_types must be a non-empty list of 'kda'/'mla', got {list(self.layer_types)}")
        if self.kda_num_v_heads % self.kda_num_heads:
            raise ModelConfigError(f"kda_num_v_heads ({self.kda_num_v_heads}) must be a multiple of kda_num_heads")
        if not 1 <= self.attn_res_blocks <= 2 * self.num_layers:
            raise ModelConfigError(f"attn_res_blocks must be in [1, {2 * self.num_layers}] (the sublayers)")
        if self.attn_res_block_layers < 0:
            raise ModelConfigError("attn_res_block_layers must be >= 0")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok must be in [1, {self.num_experts}]")
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ModelConfigError(f"first_dense_layers must be in [0, {self.num_layers}]")
        if self.mla_rope and self.qk_rope_head_dim % 2:
            raise ModelConfigError("qk_rope_head_dim must be even for RoPE")
        if self.hidden_act not in ("situ", "silu"):
            raise ModelConfigError(f"hidden_act must be 'situ' or 'silu', got {self.hidden_act!r}")
        if self.moe_scoring not in ("sigmoid", "softmax"):
            raise ModelConfigError(f"moe_scoring must be 'sigmoid' or 'softmax', got {self.moe_scoring!r}")
        if self.moe_num_groups < 1 or self.num_experts % self.moe_num_groups:
            raise ModelConfigError(f"moe_num_groups ({self.moe_num_groups}) must divide num_experts ({self.num_experts})")
        if not 1 <= self.moe_topk_groups <= self.moe_num_groups:
            raise ModelConfigError(f"moe_topk_groups must be in [1, {self.moe_num_groups}]")
        if self.moe_layer_freq < 1:
            raise ModelConfigError("moe_layer_freq must be >= 1")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ModelConfigError(f"cache_dtype must be one of {', '.join(CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.moe_latent_norm and not self.moe_latent_size:
            raise ModelConfigError("moe_latent_norm needs a latent MoE (moe_latent_size > 0)")

    # ---- derived shape ------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    @property
    def sublayers_per_block(self) -> int:
        if self.attn_res_block_layers:
            return 2 * self.attn_res_block_layers
        return -(-2 * self.num_layers // self.attn_res_blocks)

    @property
    def mla_latent_norm_eps(self) -> float:
        return self.rms_norm_eps if self.mla_norm_eps is None else self.mla_norm_eps

    @property
    def expert_input_size(self) -> int:
        """Width the routed experts work in: the latent, or the hidden size without one."""
        return self.moe_latent_size or self.hidden_size

    @property
    def kda_qk_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def kda_v_dim(self) -> int:
        return self.kda_num_v_heads * self.kda_v_head_dim

    @property
    def kda_conv_dim(self) -> int:
        """Channels of the short convolutions (q, k and v side by side)."""
        return 2 * self.kda_qk_dim + self.kda_v_dim

    @property
    def mla_latent_dim(self) -> int:
        """Floats cached per token per MLA layer: c_kv then k_rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_dense_layers and i % self.moe_layer_freq == 0

    # ---- Hugging Face config.json -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> K3Config:
        if cfg.get("model_type") != MODEL_TYPE:
            raise ModelConfigError(f"config.json model_type is {cfg.get('model_type')!r}, not {MODEL_TYPE!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        # transformers' generic fields (hf_config.GENERIC_FIELDS) are ignored by name, length keys
        # give the context window; anything else this model does not know is an error
        unknown = sorted(set(cfg) - names - GENERIC_FIELDS - set(LENGTH_KEYS) - {"quantization_config"})
        if unknown:
            raise ModelConfigError(f"config.json has fields a kimi_k3 model does not know: {', '.join(unknown)}")
        values: dict[str, Any] = {k: v for k, v in cfg.items() if k in names}
        try:
            check_generic(cfg)
            values["max_position_embeddings"] = context_window(cfg)
        except HfConfigError as exc:
            raise ModelConfigError(str(exc)) from None
        eos = cfg.get("eos_token_id")
        values["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        values["layer_types"] = tuple(values.get("layer_types", ()))
        try:
            return cls(**values)
        except TypeError as exc:  # a missing field
            raise ModelConfigError(f"config.json: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layer_types"] = list(self.layer_types)
        eos = list(out.pop("eos_token_ids"))
        out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        return {"model_type": MODEL_TYPE, "architectures": ["KimiK3ForCausalLM"], "torch_dtype": "float32", **out}


def _k3_layer_types() -> tuple[str, ...]:
    # 93 layers, 24 MLA: every fourth layer is MLA (23 of them in 92 layers) plus the last one.
    return tuple("mla" if i % 4 == 3 or i == 92 else "kda" for i in range(93))


K3_FULL = K3Config(
    vocab_size=160 * 1024, hidden_size=7168, layer_types=_k3_layer_types(),
    first_dense_layers=1, dense_intermediate_size=33792,
    kda_num_heads=96, kda_num_v_heads=96, kda_head_dim=128, kda_v_head_dim=128, kda_gate_rank=128,
    kda_conv_width=4, kda_lower_bound=-5.0,
    mla_num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, rope_theta=50000.0,
    num_experts=896, num_shared_experts=2, num_experts_per_tok=16, moe_latent_size=3584,
    moe_intermediate_size=3072, shared_intermediate_size=3072, routed_scaling_factor=2.5,
    attn_res_blocks=8, situ_beta_gate=4.0, situ_beta_up=25.0, rms_norm_eps=1e-6,
    max_position_embeddings=1 << 20, tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(),
    cache_dtype="bfloat16",
)

NANO = K3Config(
    vocab_size=KIMI_VOCAB_SIZE, hidden_size=64, layer_types=("kda", "kda", "mla", "kda", "kda", "mla"),
    first_dense_layers=1, dense_intermediate_size=128,
    kda_num_heads=2, kda_num_v_heads=4, kda_head_dim=16, kda_v_head_dim=16, kda_gate_rank=16,
    kda_conv_width=4, kda_lower_bound=-5.0,
    mla_num_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=16, rope_theta=10000.0,
    num_experts=8, num_shared_experts=1, num_experts_per_tok=2, moe_latent_size=32,
    moe_intermediate_size=32, shared_intermediate_size=64, routed_scaling_factor=1.0,
    attn_res_blocks=3, situ_beta_gate=4.0, situ_beta_up=25.0, rms_norm_eps=1e-6,
    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=None,
    eos_token_ids=(163585, 163586),  # [EOS] and <|im_end|> in the Kimi tokenizer
)

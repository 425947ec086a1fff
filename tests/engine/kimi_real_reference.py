"""An independent fp32 forward pass of the real Kimi text models, from the public modeling code's
math (Moonshot's ``modeling_kimi*.py`` for Kimi-Linear and K3, fla's KDA gate references), over
tensors under their REAL names — no Crescent model code, no cache, no pages: the whole sequence
at once, the delta rule token by token, MLA expanded (not absorbed) with an explicit causal mask.
It computes in float64, so it gives the exact logits of the fp32 weights: an fp32 run of the same
math differs from them by its own rounding (up to ~8e-5 relative on the tiny K3 checkpoint).

A serving engine that *stores* some values in a narrower dtype reads them back rounded. With
``storage=Storage(torch.bfloat16, block_size)`` the reference rounds exactly what such a cache
stores and re-reads, where it re-reads it:

- every MLA layer's cached latent — the normed ``c_kv`` and the (NoPE) decoupled key — for every
  token, the current ones included (attention reads them all from the cache);
- the KDA short convolutions' inputs that reach a token through the stored conv tail: those of
  an earlier block (the tail is stored at each block boundary); a token's own block's inputs
  stay exact. KDA recurrent states are never rounded (they are kept in fp32).

    logits = reference_logits(text_config, weights, token_ids)   # [T, vocab], float64
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Storage:
    """What a cache stores in a narrower dtype: MLA latents and conv tails in ``dtype``, the
    tail stored at every ``block_size``-token block boundary."""

    dtype: torch.dtype
    block_size: int

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).to(x.dtype)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def _mlp(t: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = _lin(x, w[p + "gate_proj.weight"]), _lin(x, w[p + "up_proj.weight"])
    return _lin(_glu(t, gate, up), w[p + "down_proj.weight"])


def _glu(t: dict, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if t["hidden_act"] == "silu":
        return F.silu(gate) * up
    beta, linear_beta = t.get("activation_situ_beta") or 1.0, t.get("activation_situ_linear_beta")
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up


def _short_conv(x: torch.Tensor, weight: torch.Tensor, storage: Storage | None) -> torch.Tensor:
    """Causal depthwise conv (nn.Conv1d weight [C, 1, W], left padding W-1) then SiLU: x [T, C].
    With ``storage``, token i reads the inputs of earlier blocks rounded (from the stored tail)."""
    width = weight.shape[-1]
    if storage is None:
        y = F.conv1d(x.T[None], weight, padding=width - 1, groups=x.shape[1])[0, :, : x.shape[0]]
        return F.silu(y).T
    rounded = storage.round(x)
    y = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for tap in range(width):
            j = i - (width - 1) + tap
            if j >= 0:
                earlier_block = j // storage.block_size < i // storage.block_size
                y[i] += weight[:, 0, tap] * (rounded[j] if earlier_block else x[j])
    return F.silu(y)


def _kda(t: dict, w: dict, p: str, x: torch.Tensor, storage: Storage | None) -> torch.Tensor:
    la = t["linear_attn_config"]
    h, k = la["num_heads"], la["head_dim"]
    n = x.shape[0]
    q, kk, v = (_short_conv(_lin(x, w[p + f"{c}_proj.weight"]), w[p + f"{c}_conv1d.weight"], storage).view(n, h, k)
                for c in "qkv")
    f = _lin(_lin(x, w[p + "f_a_proj.weight"]), w[p + "f_b_proj.weight"]).view(n, h, k) + w[p + "dt_bias"].view(h, k)
    a = w[p + "A_log"].reshape(-1)[:h].view(h, 1).exp()  # K3 pads the buffer past H with zeros
    if la.get("gate_lower_bound") is None:
        g = -a * F.softplus(f)
    else:
        g = la["gate_lower_bound"] * torch.sigmoid(a * f)
    beta = torch.sigmoid(_lin(x, w[p + "b_proj.weight"]))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * k ** -0.5
    kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
    state = x.new_zeros(h, k, k)
    out = x.new_zeros(n, h, k)
    for i in range(n):
        state = state * g[i].exp()[..., None]
        err = v[i] - torch.einsum("hk,hkv->hv", kk[i], state)
        state = state + torch.einsum("hk,hv->hkv", kk[i], beta[i][:, None] * err)
        out[i] = torch.einsum("hk,hkv->hv", q[i], state)
    if la.get("use_full_rank_gate"):
        gate = _lin(x, w[p + "g_proj.weight"])
    else:
        gate = _lin(_lin(x, w[p + "g_a_proj.weight"]), w[p + "g_b_proj.weight"])
    o = _rms(out, w[p + "o_norm.weight"], t["rms_norm_eps"]) * torch.sigmoid(gate.view(n, h, k))
    return _lin(o.reshape(n, h * k), w[p + "o_proj.weight"])


def _mla(t: dict, w: dict, p: str, x: torch.Tensor, storage: Storage | None) -> torch.Tensor:
    n, heads = x.shape[0], t["num_attention_heads"]
    dn, dr, dv, dc = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"], t["kv_lora_rank"]
    latent_eps = 1e-6  # q_a_layernorm / kv_a_layernorm keep the RMSNorm class default
    if t.get("q_lora_rank"):
        q = _lin(_rms(_lin(x, w[p + "q_a_proj.weight"]), w[p + "q_a_layernorm.weight"], latent_eps), w[p + "q_b_proj.weight"])
    else:
        q = _lin(x, w[p + "q_proj.weight"])
    q = q.view(n, heads, dn + dr)
    kv = _lin(x, w[p + "kv_a_proj_with_mqa.weight"])
    latent, k_rope = _rms(kv[:, :dc], w[p + "kv_a_layernorm.weight"], latent_eps), kv[:, dc:]
    if storage is not None:  # what a cache keeps per token, read back for every query
        latent, k_rope = storage.round(latent), storage.round(k_rope)
    k_pass = _lin(latent, w[p + "kv_b_proj.weight"]).view(n, heads, dn + dv)
    # NoPE: the "rope" halves of q and k join the scores unrotated; k's is shared by all heads
    keys = torch.cat([k_pass[..., :dn], k_rope[:, None].expand(n, heads, dr)], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * (dn + dr) ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), k_pass[..., dn:]).reshape(n, heads * dv)
    if t.get("mla_use_output_gate"):
        o = o * torch.sigmoid(_lin(x, w[p + "g_proj.weight"]))
    return _lin(o, w[p + "o_proj.weight"])


def _moe(t: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    logits = _lin(x, w[p + "gate.weight"])
    scores = logits.sigmoid() if t["moe_router_activation_func"] == "sigmoid" else logits.softmax(-1)
    top_k = t["num_experts_per_token"]
    idx = torch.topk(scores + w[p + "gate.e_score_correction_bias"], top_k, dim=-1, sorted=False).indices
    weight = scores.gather(1, idx)
    if top_k > 1 and t["moe_renormalize"]:
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    weight = weight * t["routed_scaling_factor"]
    latent = t.get("routed_expert_hidden_size")
    h = _lin(x, w[p + "routed_expert_down_proj.weight"]) if latent else x
    y = torch.zeros_like(h)
    for tok in range(x.shape[0]):
        for j in range(top_k):
            e = p + f"experts.{int(idx[tok, j])}."
            act = _glu(t, _lin(h[tok], w[e + "w1.weight"]), _lin(h[tok], w[e + "w3.weight"]))
            y[tok] += weight[tok, j] * _lin(act, w[e + "w2.weight"])
    if latent:
        if t.get("latent_moe_use_norm"):
            y = _rms(y, w[p + "routed_expert_norm.weight"], t["rms_norm_eps"])
        y = _lin(y, w[p + "routed_expert_up_proj.weight"])
    if t.get("num_shared_experts"):
        y = y + _mlp(t, w, p + "shared_experts.", x)
    return y


def _attn_res(v: list[torch.Tensor], proj: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """softmax over the candidates of <RMSNorm(v_n) * norm, proj>, mixing the raw v_n."""
    stack = torch.stack(v, dim=1)  # [T, N, D]
    keys = stack * torch.rsqrt(stack.pow(2).mean(-1, keepdim=True) + eps)
    probs = (keys * (norm * proj.reshape(-1))).sum(-1).softmax(-1)
    return (probs[..., None] * stack).sum(1)


def reference_logits(t: dict, w: dict[str, torch.Tensor], token_ids: list[int],
                     storage: Storage | None = None) -> torch.Tensor:
    w = {name: v.double() for name, v in w.items()}
    eps = t["rms_norm_eps"]
    kda = set(t["linear_attn_config"]["kda_layers"])
    block = t.get("attn_res_block_size")
    hidden = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    blocks: list[torch.Tensor] = []  # AttnRes: completed block representations
    for i in range(t["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attn = _kda if i + 1 in kda else _mla
        moe = i >= t["first_k_dense_replace"] and i % t.get("moe_layer_freq", 1) == 0
        ffn = (lambda z: _moe(t, w, p + "block_sparse_moe.", z)) if moe else (lambda z: _mlp(t, w, p + "mlp.", z))
        if not block:  # Kimi-Linear: a plain pre-norm residual stream
            hidden = hidden + attn(t, w, p + "self_attn.", _rms(hidden, w[p + "input_layernorm.weight"], eps), storage)
            hidden = hidden + ffn(_rms(hidden, w[p + "post_attention_layernorm.weight"], eps))
            continue
        prefix = hidden  # K3: the partial sum of the current block
        x = _attn_res(blocks + [prefix], w[p + "self_attention_res_proj.weight"],
                      w[p + "self_attention_res_norm.weight"], eps) if blocks else prefix
        if i % block == 0:
            blocks, prefix = blocks + [prefix], None
        y = attn(t, w, p + "self_attn.", _rms(x, w[p + "input_layernorm.weight"], eps), storage)
        prefix = y if prefix is None else prefix + y
        x = _attn_res(blocks + [prefix], w[p + "mlp_res_proj.weight"], w[p + "mlp_res_norm.weight"], eps)
        hidden = prefix + ffn(_rms(x, w[p + "post_attention_layernorm.weight"], eps))
    if block:
        hidden = _attn_res(blocks + [hidden], w["model.output_attn_res_proj.weight"], w["model.output_attn_res_norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if t.get("tie_word_embeddings") else w["lm_head.weight"]
    return _lin(_rms(hidden, w["model.norm.weight"], eps), head)

"""The feed-forward sublayers of kimi_k3: a dense GLU MLP (first layers) and the latent MoE.

Routing (DeepSeek-V3 ``noaux_tc``, as Moonshot's ``KimiMoEGate``): the router scores the full
hidden state (``s = sigmoid(x W_r)``, or a softmax, per ``moe_scoring``); each token picks the
top-k of ``s + offsets`` — per-expert offsets (``e_score_correction_bias``: quantile balancing
in Crescent's presets, trained in a real checkpoint), constants at serving time, so routing is
per token and deterministic — optionally only among the best ``moe_topk_groups`` of
``moe_num_groups`` expert groups (a group's score: the sum of its two best offset scores). A
token weights its experts by its raw scores, renormalised over the k when ``moe_renormalize``,
times ``routed_scaling_factor``.

Routed experts run in a down-projected latent space when the model has one
(``latent_down`` → experts → optional RMSNorm of the routed sum (K3's ``routed_expert_norm``) →
``latent_up``); shared experts see the full hidden state. Every MLP applies the model's GLU
(SiTU-GLU or SwiGLU, ``hidden_act``). Expert load is counted per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.engine.kimi_k3.ops import K3Ops, expert_counts, linear, mlp_activation, norm, pointwise


class DenseFfn:
    def __init__(self, cfg: K3Config, w: dict[str, torch.Tensor], p: str) -> None:
        self.gate_up = torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]).contiguous()
        self.down = w[p + "down_proj.weight"]
        self.act = mlp_activation(cfg.hidden_act, cfg.situ_beta_gate, cfg.situ_beta_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.act(linear(x, self.gate_up)), self.down)


@dataclass(frozen=True, slots=True)
class MoeWeights:
    router: torch.Tensor       # [E, D]
    offsets: torch.Tensor      # [E]
    latent_down: torch.Tensor | None  # [L, D], or None without a latent space
    latent_up: torch.Tensor | None    # [D, L]
    latent_norm: torch.Tensor | None  # [L]: RMSNorm weight of the routed latent (K3)
    gate_up: torch.Tensor      # [E, 2F, L]: as in the checkpoint ([out, in]); see K3Ops.expert_weights
    down: torch.Tensor         # [E, L, F]
    shared_gate_up: torch.Tensor | None  # [S, 2Fs, D]
    shared_down: torch.Tensor | None     # [S, D, Fs]

    @staticmethod
    def take(cfg: K3Config, w: dict[str, torch.Tensor], p: str) -> MoeWeights:
        latent, shared = cfg.moe_latent_size > 0, cfg.num_shared_experts > 0
        return MoeWeights(
            router=w[p + "gate.weight"], offsets=w[p + "gate.e_score_correction_bias"],
            latent_down=w[p + "latent_down.weight"] if latent else None,
            latent_up=w[p + "latent_up.weight"] if latent else None,
            latent_norm=w[p + "latent_norm.weight"] if cfg.moe_latent_norm else None,
            gate_up=w[p + "experts.gate_up_proj"], down=w[p + "experts.down_proj"],
            shared_gate_up=w[p + "shared_experts.gate_up_proj"] if shared else None,
            shared_down=w[p + "shared_experts.down_proj"] if shared else None,
        )


def route_tokens(cfg: K3Config, scores: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` fp32, expert ids ``[T, k]``) from fp32 router scores ``[T, E]``."""
    choice = scores + offsets
    groups = cfg.moe_num_groups
    if groups > 1 and cfg.moe_topk_groups < groups:
        t = choice.shape[0]
        group_scores = choice.view(t, groups, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.moe_topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(cfg.num_experts // groups, dim=1), float("-inf"))
    ids = torch.topk(choice, cfg.num_experts_per_tok, dim=-1, sorted=True).indices
    weights = scores.gather(-1, ids)
    if cfg.moe_renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    return weights * cfg.routed_scaling_factor, ids


class LatentMoe:
    def __init__(self, cfg: K3Config, weights: MoeWeights, ops: K3Ops) -> None:
        self.cfg, self.w, self.ops = cfg, weights, ops
        self.experts = ops.expert_weights(weights.gate_up, weights.down)
        self.act = mlp_activation(cfg.hidden_act, cfg.situ_beta_gate, cfg.situ_beta_up)
        # tokens routed to each expert, ever: counted where the routing is (no host read per layer)
        self.load = torch.zeros(cfg.num_experts, dtype=torch.int64, device=weights.router.device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]``, expert ids ``[T, k]``) for each token, from that token alone."""
        logits = linear(x, self.w.router).float()
        if self.cfg.moe_scoring == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = pointwise(torch.sigmoid, logits)
        return route_tokens(self.cfg, scores, self.w.offsets.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        weights, ids = self.route(x)
        self.load += expert_counts(ids, self.cfg.num_experts)
        routed_in = linear(x, w.latent_down) if w.latent_down is not None else x
        routed = self.ops.moe_routed(routed_in, weights, ids, *self.experts, self.act).to(x.dtype)
        if w.latent_norm is not None:
            routed = norm(routed, w.latent_norm, self.cfg.rms_norm_eps)
        out = linear(routed, w.latent_up) if w.latent_up is not None else routed
        if w.shared_gate_up is not None and w.shared_down is not None:
            for s in range(w.shared_gate_up.shape[0]):
                out = out + linear(self.act(linear(x, w.shared_gate_up[s])), w.shared_down[s])
        return out

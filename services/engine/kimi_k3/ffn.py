"""The feed-forward sublayers of kimi_k3: a dense SiTU-GLU FFN (first layers) and the latent MoE.

Latent MoE: the router scores the full hidden state (``s = sigmoid(x W_r)``); each token picks
the top-k of ``s + offsets`` (per-expert offsets from quantile balancing, constants at serving
time, so routing is per token and deterministic) and weights its experts by its raw scores
renormalised over the k, times ``routed_scaling_factor``. Routed experts run in a down-projected
latent space (``latent_down`` → experts → ``latent_up``); shared experts see the full hidden
state. Every expert is a SiTU-GLU MLP. Expert load is counted per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from crescent.kernels.moe.reference import route
from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.engine.kimi_k3.ops import K3Ops, linear, pointwise, situ_glu


class DenseFfn:
    def __init__(self, cfg: K3Config, w: dict[str, torch.Tensor], p: str) -> None:
        self.gate_up = torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]).contiguous()
        self.down = w[p + "down_proj.weight"]
        self.act = partial(situ_glu, beta_gate=cfg.situ_beta_gate, beta_up=cfg.situ_beta_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.act(linear(x, self.gate_up)), self.down)


@dataclass(frozen=True, slots=True)
class MoeWeights:
    router: torch.Tensor       # [E, D]
    offsets: torch.Tensor      # [E]
    latent_down: torch.Tensor  # [L, D]
    latent_up: torch.Tensor    # [D, L]
    gate_up: torch.Tensor      # [E, 2F, L]: as in the checkpoint ([out, in]); see K3Ops.expert_weights
    down: torch.Tensor         # [E, L, F]
    shared_gate_up: torch.Tensor | None  # [S, 2Fs, D]
    shared_down: torch.Tensor | None     # [S, D, Fs]

    @staticmethod
    def take(w: dict[str, torch.Tensor], p: str) -> MoeWeights:
        shared = p + "shared_experts.gate_up_proj" in w
        return MoeWeights(
            router=w[p + "gate.weight"], offsets=w[p + "gate.e_score_correction_bias"],
            latent_down=w[p + "latent_down.weight"], latent_up=w[p + "latent_up.weight"],
            gate_up=w[p + "experts.gate_up_proj"], down=w[p + "experts.down_proj"],
            shared_gate_up=w[p + "shared_experts.gate_up_proj"] if shared else None,
            shared_down=w[p + "shared_experts.down_proj"] if shared else None,
        )


class LatentMoe:
    def __init__(self, cfg: K3Config, weights: MoeWeights, ops: K3Ops) -> None:
        self.cfg, self.w, self.ops = cfg, weights, ops
        self.experts = ops.expert_weights(weights.gate_up, weights.down)
        self.act = partial(situ_glu, beta_gate=cfg.situ_beta_gate, beta_up=cfg.situ_beta_up)
        self.load = torch.zeros(cfg.num_experts, dtype=torch.int64)  # tokens routed to each expert, ever

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]``, expert ids ``[T, k]``) for each token, from that token alone."""
        scores = pointwise(torch.sigmoid, linear(x, self.w.router).float())
        return route(scores, self.w.offsets.float(), self.cfg.num_experts_per_tok, self.cfg.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        weights, ids = self.route(x)
        self.load += torch.bincount(ids.flatten().cpu(), minlength=self.cfg.num_experts)
        routed = self.ops.moe_routed(linear(x, w.latent_down), weights, ids, *self.experts, self.act)
        out = linear(routed.to(x.dtype), w.latent_up)
        if w.shared_gate_up is not None and w.shared_down is not None:
            for s in range(w.shared_gate_up.shape[0]):
                out = out + linear(self.act(linear(x, w.shared_gate_up[s])), w.shared_down[s])
        return out

"""The paged cache of a kimi_k3 model: MLA latents per token, KDA state snapshots per block.

A page is one block of ``page_size`` tokens, as for Llama, but holds two kinds of data:

- ``latent[m, page, slot]``: layer m's (m-th MLA layer) c_kv and k_rope of one token. Each
  layer's pages form one contiguous ``[pages, page_size, Dc + Dr]`` tensor, the layout the Triton
  MLA kernel reads.
- ``kda_state[page, j]`` and ``conv_tail[page, j]``: the j-th KDA layer's recurrent state
  ``[HV, K, V]`` and short-convolution tail ``[conv_dim, W - 1]`` *after the last token written
  to the page*. For a full page that is the state at the block boundary (the snapshot a prefix
  hit resumes from); for a sequence's last, partial page it is the live state that the next
  token continues. A token only ever writes the page it falls in, so pages shared through the
  prefix cache (full, registered) are never modified.

A block payload (kvstore or handoff) is one flat fp32 tensor: the page's state region, then the
latents token-major ``[tokens, mla_layers, Dc + Dr]``, so a partial block is a prefix of a full one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.engine.kv_cache import PageManager


class K3Cache:
    def __init__(self, cfg: K3Config, num_pages: int, page_size: int, device: torch.device | str = "cpu") -> None:
        self.page_size = page_size
        self.pages = PageManager(num_pages)
        n_mla, n_kda = len(cfg.mla_layers), len(cfg.kda_layers)
        self._latent_dim = cfg.mla_latent_dim
        self._token_floats = n_mla * cfg.mla_latent_dim
        state_shape = (n_kda, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim)
        tail_shape = (n_kda, cfg.kda_conv_dim, cfg.kda_conv_width - 1)
        state_floats = state_shape[0] * state_shape[1] * state_shape[2] * state_shape[3]
        self._state_floats = state_floats + tail_shape[0] * tail_shape[1] * tail_shape[2]
        self.latent = torch.zeros((n_mla, num_pages, page_size, cfg.mla_latent_dim), device=device)
        self.state = torch.zeros((num_pages, self._state_floats), device=device)
        self.kda_state = self.state[:, :state_floats].view(num_pages, *state_shape)
        self.conv_tail = self.state[:, state_floats:].view(num_pages, *tail_shape)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.payload_shape(self.page_size)

    @property
    def capacity_tokens(self) -> int:
        return self.pages.num_pages * self.page_size

    def page_bytes(self) -> int:
        return self.block_shape[0] * 4

    def nbytes(self) -> int:
        return (self.latent.numel() + self.state.numel()) * 4

    def payload_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (self._state_floats + num_tokens * self._token_floats,)

    def payload_tokens(self, shape: Sequence[int]) -> int:
        shape = tuple(shape)
        tokens = (shape[0] - self._state_floats) // max(self._token_floats, 1) if len(shape) == 1 else -1
        if not 0 < tokens <= self.page_size or self.payload_shape(tokens) != shape:
            raise ValueError(f"K3 block payload shape {shape} does not fit pages of shape {self.block_shape}")
        return tokens

    def read_block(self, page: int, num_tokens: int | None = None) -> torch.Tensor:
        n = self.page_size if num_tokens is None else num_tokens
        latents = self.latent[:, page, :n].transpose(0, 1).reshape(-1)
        return torch.cat([self.state[page], latents])

    def write_block(self, page: int, payload: torch.Tensor) -> None:
        tokens = self.payload_tokens(payload.shape)
        flat = payload.reshape(-1)
        self.state[page].copy_(flat[: self._state_floats])
        latents = flat[self._state_floats :].view(tokens, -1, self._latent_dim)
        self.latent[:, page, :tokens].copy_(latents.transpose(0, 1))

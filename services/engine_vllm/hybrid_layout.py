"""Which of vLLM's KV cache groups the connector carries, and how (read from vLLM's
``KVCacheConfig``; no vLLM import, so the rules are testable without it).

vLLM's hybrid memory allocator (HMA) gives each group of layers its own block table:

- **attention** groups (full attention, MLA): one block holds ``block_size`` tokens' KV rows;
  block ``i`` of the prompt is the same rows on every instance, so it is saved and loaded as a
  Crescent block under the prompt's key ``i``;
- **state** groups (Mamba-style recurrent layers: Mamba, GDN, Kimi's KDA; ``MambaSpec``): in
  vLLM's ``align`` cache mode, block ``i`` holds the layers' recurrent state *after* token
  ``(i + 1) * block_size``, and only where vLLM kept one (the end of a scheduled chunk, its
  prefill checkpoint; interior blocks are null). A state is therefore a sparse snapshot: the
  connector saves it beside block ``i``'s KV whenever vLLM's own cache holds it, under a key of
  its own (``state_key``), and a prefix hit can only resume at a block whose state was saved:
  the longest stored prefix is cut back to the nearest snapshot at or below it, and vLLM
  computes the rest, exactly.

Any other group (sliding window, chunked local, cross attention, a state group outside
``align`` mode) has no block-aligned prefix the connector could name; such a model is served
with the connector passive (no lookups, no saves; vLLM's own prefix cache still works).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass


def _kinds(spec: object) -> set[str]:
    return {cls.__name__ for cls in type(spec).__mro__}


@dataclass(frozen=True, slots=True)
class GroupLayout:
    attention_groups: tuple[int, ...]
    state_groups: tuple[int, ...]
    layer_groups: dict[str, int]      # layer name -> its KV cache group
    unsupported: str = ""             # why the connector stays passive ("" : it carries every group)

    @property
    def hybrid(self) -> bool:
        return bool(self.state_groups)

    @property
    def carried(self) -> bool:
        return not self.unsupported


def group_layout(kv_cache_config: object | None) -> GroupLayout:
    """The layout of vLLM's groups; ``None`` (no config handed to the connector): one attention group."""
    if kv_cache_config is None:
        return GroupLayout((0,), (), {})
    attention: list[int] = []
    state: list[int] = []
    layers: dict[str, int] = {}
    problems: list[str] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):  # type: ignore[attr-defined]
        spec = group.kv_cache_spec
        kinds = _kinds(spec)
        layers.update(dict.fromkeys(group.layer_names, index))
        if "MambaSpec" in kinds:
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode != "align":
                problems.append(f"group {index}: recurrent state in {mode!r} cache mode (block-aligned states need "
                                "'align', which vLLM picks when prefix caching is on)")
            state.append(index)
        elif "FullAttentionSpec" in kinds and not kinds & {"SlidingWindowSpec", "ChunkedLocalAttentionSpec"}:
            attention.append(index)
        else:
            problems.append(f"group {index}: {type(spec).__name__}")
    if not attention:
        problems.append("no full-attention group")
    return GroupLayout(tuple(attention), tuple(state), layers, "; ".join(problems))


def state_key(block_key: bytes, state_format: str) -> bytes:
    """The key a block's recurrent-state snapshot is stored under: the block's own key (so salted
    per tenant like it) and the state's format (another layout or model can never find it)."""
    h = hashlib.blake2b(digest_size=len(block_key))
    h.update(b"crescent-vllm-state\x00")
    h.update(state_format.encode())
    h.update(b"\x00")
    h.update(block_key)
    return h.digest()


def resume_point(present: list[bool], has_state: list[bool]) -> int:
    """How many of a prompt's next blocks a hybrid load may take: the longest run of stored
    blocks (``present``, from the first) cut back to the last one with a saved state (its
    ``has_state``): the recurrent layers resume from that state, nowhere else."""
    run = 0
    for here in present:
        if not here:
            break
        run += 1
    for count in range(run, 0, -1):
        if has_state[count - 1]:
            return count
    return 0


def state_format(kv_cache_config: object | None, layout: GroupLayout) -> str:
    """What a snapshot's bytes mean: each state group's shapes, dtypes and kernel family, and the
    conv-state layout vLLM was told to use. Part of every snapshot's key."""
    if kv_cache_config is None or not layout.hybrid:
        return ""
    groups = kv_cache_config.kv_cache_groups  # type: ignore[attr-defined]
    parts = []
    for index in layout.state_groups:
        spec = groups[index].kv_cache_spec
        kind = getattr(spec, "mamba_type", "")
        parts.append(f"{len(groups[index].layer_names)}x{spec.shapes}:{spec.dtypes}:{getattr(kind, 'name', kind)}")
    conv = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "")
    return f"vllm-state-v1:{conv}:" + ";".join(parts)

"""The connector's scheduler side (vLLM's engine-core process): which prompt blocks to load from
the kvstore, which to save, and what vLLM's own cache holds (for the scheduler's prefix index).

Keys are Crescent's (``hash(parent, tokens, model_id, salt)``, the tenant's salt from the
request's vLLM cache salt), so a vLLM instance and a native one of the same model name the same
prefixes alike. A prompt the instance marked private (Kimi's short-prompt rule) is neither looked
up nor saved nor reported; one under a handoff's one-time salt is saved and loaded, not reported.
Lookups ask the node which leading blocks it holds (``Exists``);
the last prompt token is never loaded (vLLM computes at least one token to sample from).

A hybrid model (recurrent-state groups beside attention, hybrid_layout.py) also needs the state
its recurrent layers resume from: a hit is cut back to the last block whose snapshot the store
holds, and is loaded asynchronously (vLLM holds the request until the worker reports it): vLLM
takes block-level load errors only from single-group models, so a hybrid load that fails is
reported for its whole request, which vLLM then recomputes from its start. When a hybrid request
finishes, the keys a decode would resume it from (the blocks up to its last saved snapshot, and
that snapshot) go back with vLLM's output as ``kv_transfer_params`` (``HANDOFF_KEYS``): a vLLM
prefill waits for exactly those before it hands the prompt over (handoff.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from crescent.protos import common_pb2
from crescent.services.engine_vllm.block_events import BlockEventSender
from crescent.services.engine_vllm.connector_metadata import CrescentConnectorMetadata, LoadSpec, SaveSpec, StateSaveSpec
from crescent.services.engine_vllm.connector_options import ConnectorOptions, crescent_salt, loadable_blocks, shared_salt
from crescent.services.engine_vllm.hybrid_layout import GroupLayout, resume_point, state_key
from crescent.services.engine_vllm.store_link import StoreLink
from crescent.services.contract.block_keys import BlockKey, prefix_block_keys

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# kv_transfer_params entry of a finished hybrid request: the store keys (hex) a decode resumes it
# from, in load order; empty when no snapshot lies within its loadable blocks, or when the
# connector is passive for the model (then nothing is stored for any request).
HANDOFF_KEYS = "crescent_handoff_keys"

EVICTION_CHECK_S = 0.5  # how often vLLM's blocks are checked for evictions (a scan of those reported)


@dataclass
class _Prompt:
    """One request's prompt as the connector follows it."""

    tokens: list[int]
    salt: bytes | None          # None: private, never looked up nor saved
    keys: list[BlockKey]
    shared: bool                # False: a handoff's one-time salt, saved and loaded but not reported
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group (vLLM's tables)
    load_first: int = 0         # blocks [load_first, load_first + load_count) come from the kvstore
    load_count: int = 0
    save_from: int = 0          # blocks before it were cached here or loaded: not saved again
    saved_upto: int = 0
    states_saved: set[int] = field(default_factory=set)  # block indices whose snapshot was saved
    reported_upto: int = 0      # blocks reported held in vLLM's cache


class ConnectorScheduler:
    def __init__(self, options: ConnectorOptions, link: StoreLink | None, layout: GroupLayout | None = None,
                 state_format: str = "") -> None:
        self.options = options
        self.block_size = options.block_size
        self.layout = layout or GroupLayout((0,), (), {})
        self.state_format = state_format  # hybrid: names the snapshots' layout (part of their keys)
        self.link = link if self.layout.carried else None  # a layout it cannot carry: passive
        self._pending_loads: list[LoadSpec] = []  # hybrid loads allocated, for the next step's metadata
        self.events = BlockEventSender(options.events_socket) if options.events_socket else None
        self.pool: BlockPool | None = None
        self._prompts: dict[str, _Prompt] = {}
        self._held: dict[int, tuple[object, bytes]] = {}  # vLLM block id -> (its hash then, Crescent key)
        self._last_eviction_check = 0.0

    def _prompt(self, request: Request) -> _Prompt:
        found = self._prompts.get(request.request_id)
        if found is None:
            tokens = list(request.prompt_token_ids or [])
            vllm_salt = getattr(request, "cache_salt", None)
            salt = crescent_salt(vllm_salt)
            keys = [] if salt is None else prefix_block_keys(tokens, self.block_size, self.options.model_id, salt)
            found = self._prompts[request.request_id] = _Prompt(tokens, salt, keys, shared_salt(vllm_salt))
        return found

    # -- lookups -----------------------------------------------------------------------------------

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the kvstore adds after vLLM's own hit, and whether they load asynchronously."""
        prompt = self._prompt(request)
        prompt.load_count = 0
        prompt.load_first = num_computed_tokens // self.block_size
        if prompt.salt is None or self.link is None:
            return 0, False
        usable = loadable_blocks(len(prompt.tokens), self.block_size)
        first = prompt.load_first  # vLLM's own cache has the blocks before it
        if usable <= first:
            return 0, False
        keys = prompt.keys[first:usable]
        if self.layout.hybrid:
            present = self.link.present(keys)
            states = self.link.present([state_key(k, self.state_format) for k in keys])
            prompt.load_count = resume_point(present, states)
        else:
            prompt.load_count = self.link.leading_hits(keys)
        return prompt.load_count * self.block_size, self.layout.hybrid and prompt.load_count > 0

    def after_alloc(self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        prompt = self._prompt(request)
        if num_external_tokens == 0:
            prompt.load_count = 0
        prompt.save_from = max(prompt.save_from, prompt.load_first + prompt.load_count)
        if self.layout.hybrid and prompt.load_count:  # an async load: planned now, sent with the next step
            prompt.block_ids = [list(ids) for ids in block_ids]
            self._pending_loads.append(self._load_spec(request.request_id, prompt))
            prompt.load_count = 0

    def _load_spec(self, req_id: str, prompt: _Prompt) -> LoadSpec:
        first, end, b = prompt.load_first, prompt.load_first + prompt.load_count, self.block_size
        attention = tuple(tuple(prompt.block_ids[g][first:end]) for g in self.layout.attention_groups)
        state, state_ids = b"", ()
        if self.layout.hybrid:  # the snapshot after the last loaded block, into that block of each state group
            state = state_key(prompt.keys[end - 1], self.state_format)
            state_ids = tuple(prompt.block_ids[g][end - 1] for g in self.layout.state_groups)
        return LoadSpec(req_id, tuple(prompt.keys[first:end]),
                        tuple(tuple(prompt.tokens[i * b:(i + 1) * b]) for i in range(first, end)),
                        attention, state, state_ids)

    # -- each step ---------------------------------------------------------------------------------

    def build_meta(self, out: SchedulerOutput) -> CrescentConnectorMetadata:
        meta = CrescentConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for new in out.scheduled_new_reqs:
            prompt = self._prompts.get(new.req_id)
            if prompt is None:
                continue
            prompt.block_ids = [list(ids) for ids in new.block_ids]
            self._plan(new.req_id, prompt, new.num_computed_tokens,
                       new.num_computed_tokens + out.num_scheduled_tokens[new.req_id], meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prompt = self._prompts.get(req_id)
            if prompt is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # a resumed request's whole tables
                prompt.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                for group, ids in enumerate(new_ids):
                    prompt.block_ids[group].extend(ids)
            self._plan(req_id, prompt, cached.num_computed_tokens[i],
                       cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id], meta)
        self._report_held()
        return meta

    def _plan(self, req_id: str, prompt: _Prompt, computed_before: int, computed_after: int,
              meta: CrescentConnectorMetadata) -> None:
        if prompt.load_count:  # a synchronous load (one attention group): placed before this step's forward
            meta.loads.append(self._load_spec(req_id, prompt))
            prompt.load_count = 0
        if prompt.salt is None or self.link is None or not prompt.block_ids:
            return
        full = min(computed_after, len(prompt.tokens)) // self.block_size
        b = self.block_size
        attention = [prompt.block_ids[g] for g in self.layout.attention_groups]
        for i in range(max(prompt.saved_upto, prompt.save_from), min(full, *(len(ids) for ids in attention))):
            meta.saves.append(SaveSpec(prompt.keys[i], prompt.keys[i - 1] if i else None,
                                       tuple(prompt.tokens[i * b:(i + 1) * b]), tuple(ids[i] for ids in attention)))
        prompt.saved_upto = max(prompt.saved_upto, full)
        if self.layout.hybrid:
            self._plan_states(prompt, computed_before // self.block_size, full, meta)

    def _plan_states(self, prompt: _Prompt, first: int, full: int, meta: CrescentConnectorMetadata) -> None:
        """Snapshots vLLM keeps at the block boundaries this step passes (blocks ``first`` to
        ``full - 1``): a state block it has cached (hashed) holds the state after that block,
        written by this step's forward, before the worker copies it out (``wait_for_save``).
        Earlier boundaries are not looked at: their blocks may have been freed and reused."""
        if self.pool is None:
            return
        b = self.block_size
        tables = [prompt.block_ids[g] for g in self.layout.state_groups]
        for i in range(max(first, prompt.save_from), min(full, *(len(ids) for ids in tables))):
            if i in prompt.states_saved:
                continue
            blocks = [self.pool.blocks[ids[i]] for ids in tables]
            if any(block.is_null or block.block_hash is None for block in blocks):
                continue  # no state kept at this boundary (vLLM's interior blocks are null)
            meta.state_saves.append(StateSaveSpec(state_key(prompt.keys[i], self.state_format),
                                                  tuple(prompt.tokens[i * b:(i + 1) * b]),
                                                  tuple(block.block_id for block in blocks)))
            prompt.states_saved.add(i)

    def finished(self, request: Request) -> dict[str, list[str]] | None:
        """Forget the request; for a hybrid one, the keys a decode would resume it from (none
        where the connector is passive: nothing of it reaches the store)."""
        prompt = self._prompts.pop(request.request_id, None)
        if prompt is None:
            return None
        if not self.layout.carried:
            return {HANDOFF_KEYS: []}
        if not self.layout.hybrid or prompt.salt is None or self.link is None:
            return None
        return {HANDOFF_KEYS: [bytes(key).hex() for key in self._resume_keys(prompt)]}

    def _resume_keys(self, prompt: _Prompt) -> list[bytes]:
        """The blocks up to the last loadable boundary with a snapshot in the store (saved by this
        request, or the boundary it was itself resumed from: vLLM's own hit or a load), and that
        snapshot. A decode's lookup (``matched_tokens``) resumes there once the store holds them."""
        usable = loadable_blocks(len(prompt.tokens), self.block_size)
        ends = [i + 1 for i in prompt.states_saved if i < usable]
        if 0 < prompt.save_from <= usable:
            ends.append(prompt.save_from)
        end = max(ends, default=0)
        if not end:
            return []
        return [bytes(k) for k in prompt.keys[:end]] + [state_key(prompt.keys[end - 1], self.state_format)]

    # -- what vLLM's cache holds -------------------------------------------------------------------

    def _report_held(self) -> None:
        """Blocks vLLM now holds (hashed, so reusable by later prompts) and those it evicted."""
        if self.events is None or self.pool is None:
            return
        events: list[common_pb2.BlockEvent] = []
        for prompt in self._prompts.values():
            if prompt.salt is None or not prompt.shared:
                continue
            if not prompt.block_ids:
                continue
            table = prompt.block_ids[self.layout.attention_groups[0]]
            for i in range(prompt.reported_upto, min(len(prompt.keys), len(table))):
                block = self.pool.blocks[table[i]]
                if block.block_hash is None:
                    break
                previous = self._held.get(block.block_id)
                if previous is not None and previous[1] != prompt.keys[i]:
                    events.append(self._event(common_pb2.BLOCK_EVENT_REMOVED, previous[1]))
                self._held[block.block_id] = (block.block_hash, prompt.keys[i])
                events.append(self._event(common_pb2.BLOCK_EVENT_STORED, prompt.keys[i],
                                          prompt.keys[i - 1] if i else None))
                prompt.reported_upto = i + 1
        now = time.monotonic()
        if now - self._last_eviction_check >= EVICTION_CHECK_S:
            self._last_eviction_check = now
            for block_id, (block_hash, key) in list(self._held.items()):
                if self.pool.blocks[block_id].block_hash != block_hash:
                    del self._held[block_id]
                    events.append(self._event(common_pb2.BLOCK_EVENT_REMOVED, key))
        self.events.send(events)

    def _event(self, kind: int, key: bytes, parent: bytes | None = None) -> common_pb2.BlockEvent:
        return common_pb2.BlockEvent(kind=kind, key=key, parent_key=parent or b"", tier=common_pb2.KV_TIER_ENGINE,
                                     num_tokens=self.block_size)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()

"""The model engine shared by prefill and decode: weights, paged KV cache, forward steps.

Prefill uses ``add_sequence`` (local prefix hits), ``attach_blocks`` (prefix blocks fetched from
the kvstore), ``prefill`` and ``block_payload``; decode uses ``adopt_sequence`` (a handed-off
request and its KV) and ``decode_step``. ``generate`` runs both roles in one process: it is the
reference the disaggregated path must match token for token.

Engine methods are blocking and not thread-safe: a service calls them from one worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from crescent.services.engine.cache_api import StatefulKvCache
from crescent.services.contract.block_keys import BlockKey, prefix_block_keys
from crescent.services.contract.finish import finish_reason
from crescent.services.engine.kv_cache import PagedKvCache
from crescent.services.engine.llama import ForwardBatch, LlamaModel, SeqChunk
from crescent.services.engine.model_config import LlamaConfig
from crescent.services.engine.constraints import TokenConstraint
from crescent.services.engine.sampler import SamplingConfig, sample_batch

log = logging.getLogger(__name__)

# ``prefill``'s per-layer hook: (layer, end) once that layer's KV of the first ``end`` tokens is final.
LayerHook = Callable[[int, int], None]


@dataclass(slots=True)
class Sequence:
    """A request's tokens and the pages that hold their KV."""

    seq_id: str
    token_ids: list[int]
    block_keys: list[BlockKey]           # keys of the prompt's full blocks
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0                # leading tokens whose KV is in ``pages``
    num_cached: int = 0                  # of the prompt, tokens reused rather than computed
    num_registered: int = 0              # leading full blocks entered in the prefix map
    reserved_pages: int = 0              # pages promised to it and not drawn yet (decode)
    keeps_blocks: bool = True            # its computed full blocks may be cached (see min_cached_prompt_tokens)
    state: int | None = None             # recurrent-state models: its live state in the cache (open_state)
    prompt_tokens: int = 0               # of a prompt added here (add_sequence); 0 for adopted / forked ones
    decode_tail: int = 0                 # last tokens decode generated (a moved request's): computed a row each

    @property
    def cacheable_prompt(self) -> int:
        """Prompt tokens whose full blocks may go to the prefix cache (0 when none may)."""
        return self.prompt_tokens if self.keeps_blocks else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def prefill_step_end(seq: Sequence, chunk_tokens: int) -> int:
    """Where ``seq``'s next prefill step ends: up to ``chunk_tokens`` more of its prompt, never
    into its decode tail (``Engine.add_sequence``); then the whole tail in one step, a row per
    token, as decode's steps computed it."""
    tail_start = seq.num_tokens - seq.decode_tail
    if seq.num_computed < tail_start:
        return min(tail_start, seq.num_computed + chunk_tokens)
    return seq.num_tokens


def host_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as float32 on the host, where every rule and draw of ``sampler.py`` runs: a row's
    tokens then depend on its logits' bits only, not on the device that sampled them. A bf16 row
    crosses as bf16 (half the bytes) and widens on the host, exactly. Float32 CPU logits: as is."""
    if logits.device.type != "cpu":
        logits = logits.to("cpu")  # the step's one host sync: the tokens are needed here anyway
    return logits.float()


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        *,
        model_id: str,
        kv_capacity_tokens: int,
        block_size: int,
        prefill_chunk_tokens: int = 2048,
        min_cached_prompt_tokens: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """``min_cached_prompt_tokens``: a prompt of at most this many tokens leaves no blocks in the
        prefix cache (nor, through prefill, in the kvstore or the scheduler's index), so whether a
        short, guessable prompt was sent before never shows in ``cached_tokens`` or timing; it may
        still reuse blocks a longer prompt left. Kimi's API rule is 256 (EngineSettings' default).
        ``kv_cache_dtype``: the Llama pool's dtype (None: the model's); the pool lives on the model's device."""
        if kv_capacity_tokens < block_size:
            raise ValueError(f"kv_capacity_tokens ({kv_capacity_tokens}) must hold at least one page ({block_size})")
        cfg = model.config
        self.model = model
        self.config: LlamaConfig = cfg
        self.model_id = model_id
        self.block_size = block_size
        self.min_cached_prompt_tokens = min_cached_prompt_tokens
        self.prefill_chunk_tokens = max(block_size, prefill_chunk_tokens - prefill_chunk_tokens % block_size)
        num_pages = kv_capacity_tokens // block_size
        make_cache = getattr(model, "make_cache", None)  # models with their own page layout (kimi_k3)
        if make_cache is not None:
            self.cache = make_cache(num_pages, block_size)
        else:
            self.cache = PagedKvCache(num_pages, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                      dtype=kv_cache_dtype or getattr(model, "dtype", torch.float32),
                                      device=getattr(model, "device", "cpu"))
        # A cache with recurrent states (kimi_k3) gives each sequence one live state, and a prefix
        # hit resumes only where it kept a state snapshot (see kimi_k3/cache.py).
        self._stateful = isinstance(self.cache, StatefulKvCache)

    # ---- sequences -------------------------------------------------------------------------

    def block_keys(self, token_ids: Seq[int], salt: bytes = b"") -> list[BlockKey]:
        return prefix_block_keys(token_ids, self.block_size, self.model_id, salt)

    def add_sequence(self, seq_id: str, token_ids: Seq[int], *, salt: bytes = b"", use_cache: bool = True,
                     decode_tail: int = 0) -> Sequence:
        """A new prompt; its longest locally cached prefix is attached (never the whole prompt:
        the last token is always computed, since its logits give the first new token).

        ``decode_tail``: the prompt's last tokens were generated by decode (a request moved after
        its decode failed: its prompt is the first prompt plus the tokens streamed). They are
        computed as decode computed them, one row per token (``prefill_step_end``), so the logits
        and KV are decode's bit for bit and a seeded draw continues exactly. Ignored for
        recurrent-state models, whose rows of one sequence cannot share a forward."""
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        if len(token_ids) > self.config.max_position_embeddings:
            raise ValueError(f"{len(token_ids)} tokens exceed the context window ({self.config.max_position_embeddings})")
        keys = self.block_keys(token_ids, salt)
        client_prompt = len(token_ids) - max(decode_tail, 0)  # Kimi's rule counts the client's prompt, not streamed tokens
        seq = Sequence(seq_id, list(token_ids), keys, keeps_blocks=client_prompt > self.min_cached_prompt_tokens,
                       prompt_tokens=len(token_ids))
        if decode_tail > 0 and not self._stateful:
            seq.decode_tail = min(decode_tail, len(token_ids) - 1)
        if self._stateful:
            seq.state = self.cache.open_state()
        if use_cache:
            usable = keys[: (len(token_ids) - 1) // self.block_size]
            blocks = [token_ids[i * self.block_size : (i + 1) * self.block_size] for i in range(len(usable))]
            seq.pages = self.cache.pages.match_prefix(usable, blocks)
            if self._stateful:  # resume from the last snapshot in the match; the rest is recomputed
                keep = self.cache.resumable(seq.pages)
                self.cache.pages.release(seq.pages[keep:])
                seq.pages = seq.pages[:keep]
                if keep:
                    self.cache.resume_state(seq.state, seq.pages[-1])
            seq.num_computed = seq.num_cached = seq.num_registered = len(seq.pages) * self.block_size
        return seq

    def missing_prefix_keys(self, seq: Sequence) -> list[BlockKey]:
        """Keys of the usable prefix blocks after the ones already attached, for a kvstore lookup."""
        usable = (seq.num_tokens - 1) // self.block_size
        return seq.block_keys[seq.num_computed // self.block_size : usable]

    def attach_blocks(self, seq: Sequence, payloads: Seq[torch.Tensor]) -> int:
        """Append fetched prefix blocks (each of ``block_shape``) after the attached ones; returns tokens added."""
        assert seq.num_computed % self.block_size == 0, "blocks attach only at a block boundary"
        first = seq.num_computed // self.block_size
        usable = (seq.num_tokens - 1) // self.block_size
        payloads = list(payloads)[: usable - first]
        if self._stateful:  # up to the last block that carries a state: the sequence resumes there
            carrying = [i for i, p in enumerate(payloads) if self.cache.payload_has_state(p.shape)]
            payloads = payloads[: carrying[-1] + 1] if carrying else []
        if not payloads:
            return 0
        pages = self.cache.pages.allocate(len(payloads))
        for i, (page, payload) in enumerate(zip(pages, payloads)):
            if not self._stateful:
                self.cache.write_block(page, payload.view(self.cache.block_shape))
            elif i == len(payloads) - 1:
                self.cache.write_block(page, payload, state=seq.state)
            else:
                self.cache.write_block(page, payload)
        seq.pages.extend(pages)
        added = len(payloads) * self.block_size
        seq.num_computed += added
        seq.num_cached += added
        self._register_full_blocks(seq)
        return added

    def pages_for(self, num_tokens: int) -> int:
        """KV pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def adopt_sequence(self, seq_id: str, token_ids: Seq[int], num_kv_tokens: int, payloads: Seq[torch.Tensor],
                       *, reserve_tokens: int = 0) -> Sequence:
        """A handed-off request: ``payloads`` hold the KV of its first ``num_kv_tokens`` tokens,
        one tensor of ``cache.payload_shape(tokens)`` per block, the last one possibly partial
        (for hybrid models it also carries the recurrent state after the block's last token).

        ``reserve_tokens``: pages for this many tokens are promised to the sequence for its
        life (its payload pages draw on them first), so growing up to that length never fails.
        Raises ``CacheFullError`` when the pages are not there; nothing is held then."""
        reserve = max(self.pages_for(reserve_tokens), len(payloads))
        self.cache.pages.reserve(reserve)
        seq = Sequence(seq_id, list(token_ids), [], reserved_pages=reserve)
        try:
            seq.pages = self.cache.pages.allocate(len(payloads), reserved=True)
            seq.reserved_pages -= len(payloads)
            if self._stateful:  # the last block carries the state after the last token; decode caches nothing
                seq.state = self.cache.open_state()
                for i, (page, payload) in enumerate(zip(seq.pages, payloads)):
                    last = i == len(payloads) - 1
                    self.cache.write_block(page, payload, state=seq.state if last else None, snapshot=False)
            else:
                for page, payload in zip(seq.pages, payloads):
                    self.cache.write_block(page, payload)
        except BaseException:
            self.release(seq)
            raise
        seq.num_computed = num_kv_tokens
        return seq

    def fork_sequence(self, seq: Sequence, seq_id: str, first_token: int, *, reserve_tokens: int) -> Sequence:
        """Another choice of ``seq``'s prompt (``n > 1``): a sequence of the prompt plus
        ``first_token`` whose full prompt pages are ``seq``'s own (shared, one more reference each;
        no token ever writes a full page) and whose last partial page is a copy, since the next
        token writes into it. Call it before ``seq`` decodes.

        ``reserve_tokens``: as for ``adopt_sequence``; the shared pages are not counted again.
        Raises ``CacheFullError`` when its own pages are not there; nothing is held then."""
        prompt = seq.num_computed
        # Before ``seq`` decodes: its prompt computed, with or without its own first token appended.
        assert prompt in (seq.num_tokens - 1, seq.num_tokens), f"{seq.seq_id}: fork before decoding"
        full = prompt // self.block_size
        own = max(self.pages_for(reserve_tokens) - full, self.pages_for(prompt) - full)
        self.cache.pages.reserve(own)
        child = Sequence(seq_id, [*seq.token_ids[:prompt], first_token], [], reserved_pages=own)
        child.pages = self.cache.pages.share(seq.pages[:full])
        try:
            if self._stateful:
                child.state = self.cache.open_state()
                self.cache.copy_state(seq.state, child.state)
            if prompt % self.block_size:
                (page,) = self.cache.pages.allocate(1, reserved=True)
                child.reserved_pages -= 1
                child.pages.append(page)
                self.cache.write_block(page, self.cache.read_block(seq.pages[full], prompt % self.block_size))
        except BaseException:
            self.release(child)
            raise
        child.num_computed = prompt
        return child

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's pages and what is left of its reservation; its registered
        full blocks stay cached until evicted."""
        self.cache.pages.release(seq.pages)
        self.cache.pages.unreserve(seq.reserved_pages)
        seq.pages = []
        seq.reserved_pages = 0
        if seq.state is not None:
            self.cache.close_state(seq.state)
            seq.state = None

    # ---- forward steps ---------------------------------------------------------------------

    def prefill(self, seq: Sequence, on_layer: LayerHook | None = None) -> torch.Tensor:
        """Compute every not-yet-computed token, in chunks; return the last token's logits (vocab,).
        ``on_layer(layer, end)``: layer ``layer``'s KV of the sequence's first ``end`` tokens is final."""
        logits = None
        while seq.num_computed < seq.num_tokens:
            end = prefill_step_end(seq, self.prefill_chunk_tokens)
            hook = None if on_layer is None else (lambda layer, end=end: on_layer(layer, end))
            logits = self._run([(seq, end)], want_logits=end == seq.num_tokens, on_layer=hook)
        assert logits is not None, "prefill of a fully computed sequence"
        self._register_full_blocks(seq)
        return logits[0]

    def decode_step(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Compute each sequence's one new (last) token; return logits (len(seqs), vocab)."""
        for seq in seqs:
            assert seq.num_computed == seq.num_tokens - 1, f"{seq.seq_id}: decode needs exactly one new token"
        return self._run([(seq, seq.num_tokens) for seq in seqs], want_logits=True)

    def mixed_step(self, chunks: Seq[tuple[Sequence, int]], decoding: Seq[Sequence],
                   on_layer: Callable[[int], None] | None = None) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        """One forward of prompt chunks and decode tokens together (chunked prefill, several
        prompts at once). ``chunks``: (sequence, compute up to this token) pairs of prompts being
        prefilled, one per sequence; ``decoding``: sequences each computing their one new token.
        Returns each chunk's last-token logits (vocab,) when it completes its prompt, else None,
        and the decoding sequences' logits (len(decoding), vocab). Every row is what it would be
        alone: the linear layers are batch-invariant and attention runs per sequence.
        ``on_layer(layer)``: that layer's KV of every row is in the cache (see ``LlamaModel.forward``)."""
        for seq in decoding:
            assert seq.num_computed == seq.num_tokens - 1, f"{seq.seq_id}: decode needs exactly one new token"
        for seq, end in chunks:
            assert seq.num_computed < end <= seq.num_tokens, f"{seq.seq_id}: chunk to {end}"
        completes = [end == seq.num_tokens for seq, end in chunks]
        work = [*chunks, *((seq, seq.num_tokens) for seq in decoding)]
        wanted = [i for i, done in enumerate(completes) if done] + list(range(len(chunks), len(work)))
        logits = self._run(work, logits_for=wanted, on_layer=on_layer)
        prompt_logits: list[torch.Tensor | None] = [None] * len(chunks)
        for row, i in enumerate(i for i, done in enumerate(completes) if done):
            prompt_logits[i] = logits[row]
            self._register_full_blocks(chunks[i][0])
        return prompt_logits, logits[sum(completes):]

    def _run(self, work: list[tuple[Sequence, int]], want_logits: bool = False,
             logits_for: list[int] | None = None, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute each sequence up to its end; logits of every one (``want_logits``) or of
        those at ``logits_for`` indices, in that order."""
        chunks = []
        last_rows = []  # per work item: the index of its last row among ``chunks``
        for seq, end in work:
            needed = self.pages_for(end) - len(seq.pages)
            if needed > 0:
                drawn = min(needed, seq.reserved_pages)  # a reservation first: that never fails
                if needed > drawn:
                    seq.pages.extend(self.cache.pages.allocate(needed - drawn))
                seq.pages.extend(self.cache.pages.allocate(drawn, reserved=True))
                seq.reserved_pages -= drawn
            state = -1 if seq.state is None else seq.state
            if seq.decode_tail and seq.num_computed >= seq.num_tokens - seq.decode_tail:
                # decode's tokens: a row each, as decode's steps computed them (rows are batch-invariant)
                pages = tuple(seq.pages)
                chunks += [(SeqChunk(pages, pos + 1, 1, state), [seq.token_ids[pos]])
                           for pos in range(seq.num_computed, end)]
            else:
                chunk = SeqChunk(tuple(seq.pages), end, end - seq.num_computed, state, seq.cacheable_prompt)
                chunks.append((chunk, seq.token_ids[seq.num_computed : end]))
            last_rows.append(len(chunks) - 1)
        batch = ForwardBatch.build(chunks, self.block_size)
        with torch.inference_mode():
            if logits_for is None:
                logits_for = list(range(len(work))) if want_logits else []
            logits = self.model.forward(batch, self.cache, [last_rows[i] for i in logits_for], on_layer)
        for seq, end in work:
            seq.num_computed = end
        return host_logits(logits)

    def _register_full_blocks(self, seq: Sequence) -> None:
        if not seq.keeps_blocks:
            return
        full = min(len(seq.block_keys), seq.num_computed // self.block_size)
        for i in range(seq.num_registered // self.block_size, full):
            parent = seq.block_keys[i - 1] if i else None
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.cache.pages.register(seq.pages[i], seq.block_keys[i], parent, tokens)
        seq.num_registered = max(seq.num_registered, full * self.block_size)

    # ---- KV export -------------------------------------------------------------------------

    def block_payload(self, seq: Sequence, index: int, num_tokens: int | None = None) -> torch.Tensor:
        """Block ``index`` of the sequence, of ``cache.payload_shape(num_tokens)`` (Llama: a view when full).
        A recurrent-state model's last computed block carries the sequence's live state (what a
        handoff continues from); its other blocks carry their snapshots where they have one."""
        if self._stateful and index == (seq.num_computed - 1) // self.block_size:
            return self.cache.read_block(seq.pages[index], num_tokens, state=seq.state)
        return self.cache.read_block(seq.pages[index], num_tokens)

    # ---- single-process generation ---------------------------------------------------------

    def generate(
        self,
        token_ids: Seq[int],
        max_tokens: int,
        sampling: SamplingConfig = SamplingConfig(),
        stop_token_ids: Seq[int] | None = None,
        *,
        use_cache: bool = False,
        constraint: TokenConstraint | None = None,
    ) -> list[int]:
        """Prefill then decode one request in this process; the tokens generated (stop token included).
        ``constraint`` (structured output) masks every step, as prefill and decode do."""
        stop = set(self.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
        seq = self.add_sequence("generate", token_ids, use_cache=use_cache)
        out: list[int] = []
        try:
            logits = self.prefill(seq)[None]
            while True:
                allowed = [constraint.allowed()] if constraint is not None else None
                token = sample_batch(logits, [sampling], [len(out)], [[*token_ids, *out]], allowed)[0]
                if constraint is not None:
                    constraint.advance(token)
                out.append(token)
                if finish_reason(token, len(out), max_tokens, stop) is not None:
                    return out
                seq.token_ids.append(token)
                logits = self.decode_step([seq])
        finally:
            self.release(seq)

"""Colocated baseline: every node both prefills and decodes, as in a vLLM-style deployment.

Each step runs the decode batch plus one prefill chunk (chunked prefill piggybacks on decode),
so long prompts slow everyone's tokens — the interference disaggregation removes. With
``prefix_caching=False`` nothing is reused; with it, each node reuses its own cache.
"""

from __future__ import annotations

from crescent.services.scheduler.cost_model import CostModels
from crescent.services.scheduler.datatypes import (
    DecodeCandidate, Decision, InstanceId, Placement, PlacementRequest, PrefillCandidate, Tier,
)
from crescent.services.scheduler.placement import ClusterView
from loadtest.simulator.nodes import BlockCache, DecodeNode, PrefillNode, SimRequest
from loadtest.simulator.sim import SimConfig, Simulation


class ColocatedSimulation(Simulation):
    def __init__(self, config: SimConfig, costs: CostModels | None = None) -> None:
        super().__init__(config, costs)
        n = config.prefill_instances + config.decode_instances
        capacity = None if config.cache_capacity_tokens is None else max(config.cache_capacity_tokens // config.block_size, 1)
        self.prefill = {f"c{i}": PrefillNode(f"c{i}", BlockCache(capacity)) for i in range(n)}
        self.decode = {f"c{i}": DecodeNode(f"c{i}", config.decode_max_batch, config.decode_kv_capacity_tokens) for i in range(n)}
        self._chunk_of: dict[str, int] = {}

    def _backlog_s(self, p: PrefillNode, d: DecodeNode) -> float:
        waiting = sum(r.predicted_s for r in p.queue)
        if p.current is not None and p.current.computed_tokens:
            waiting += p.current.predicted_s * (1 - p.current.done_tokens / p.current.computed_tokens)
        if d.running:  # every prefill chunk shares its step with the decode batch
            chunks = waiting / max(self.costs.prefill.seconds(self.config.chunk_tokens), 1e-9)
            waiting += chunks * self.costs.decode.step_seconds(len(d.running), d.context)
        return waiting

    def _decide(self, req: SimRequest) -> Decision:
        """No Conductor in a vLLM-style cluster: the same policy sees each node's own backlog."""
        keys = req.keys if self.config.prefix_caching else ()
        request = PlacementRequest(str(req.index), keys, req.input_length, req.output_length, self.config.block_size)
        return self.policy.place(request, self._view())

    def _view(self) -> ClusterView:
        prefill, decode = [], []
        for node_id, p in self.prefill.items():
            d = self.decode[node_id]
            prefill.append(PrefillCandidate(InstanceId(node_id), self._backlog_s(p, d), len(p.queue)))
            decode.append(DecodeCandidate(InstanceId(node_id), d.view_batch(), d.view_context(), d.view_free_kv(), d.max_batch))
        return ClusterView(prefill, decode, self.index)

    def _assign(self, req: SimRequest, p: Placement) -> None:
        node = self.prefill[p.prefill]
        req.prefill = req.decode = p.prefill  # decode where the KV already is
        req.local_blocks = p.local_blocks
        if p.pull is not None:
            req.pull_source, req.pull_blocks = p.pull.source, p.pull.blocks
        req.predicted_s = max(p.predicted_ttft_s - self._backlog_s(node, self.decode[p.prefill]), 0.0)
        d = self.decode[p.prefill]
        d.incoming += 1
        d.incoming_kv += req.kv_tokens
        d.incoming_context += req.input_length
        node.queue.append(req)
        if not d.stepping:
            self._start_step(d)

    def _start_step(self, d: DecodeNode) -> None:
        p = self.prefill[d.node_id]
        d.admit()
        extra = 0.0
        if p.current is None and p.queue:
            extra = self._begin_job(p)
        chunk_s = 0.0
        if p.current is not None:
            req = p.current
            chunk = min(self.config.chunk_tokens, req.computed_tokens - req.done_tokens)
            chunk_s = self.costs.prefill.seconds(chunk, req.cached_tokens + req.done_tokens) - self.costs.prefill.fixed_s
            p.busy_s += chunk_s
            self._chunk_of[d.node_id] = chunk
        decode_s = self.costs.decode.step_seconds(len(d.running), d.context) if d.running else 0.0
        if p.current is None and not d.running:
            d.stepping = False
            return
        d.stepping = True
        self._at(self.now + extra + chunk_s + decode_s, self._STEP, d)

    def _begin_job(self, p: PrefillNode) -> float:
        """Start the next queued prompt; returns its one-off time (prefix pull, fixed cost)."""
        req = p.queue.popleft()
        p.current = req
        reuse, transfer_s = 0, 0.0
        if self.config.prefix_caching:
            reuse = p.cache.prefix(req.keys)
            if req.pull_source:
                available = self.prefill[req.pull_source].cache.prefix(req.keys[: req.pull_blocks], touch=False)
                if available > reuse:
                    tokens = self._cached_tokens(req, available) - self._cached_tokens(req, reuse)
                    transfer_s = self.costs.transfer.seconds(tokens, Tier.ENGINE)
                    self._store(p, req.keys[reuse:available])
                    reuse = available
        req.reused_blocks = reuse
        req.cached_tokens = self._cached_tokens(req, reuse) if reuse else 0
        req.computed_tokens = req.input_length - req.cached_tokens
        req.done_tokens = 0
        return transfer_s + self.costs.prefill.fixed_s

    def _step_done(self, d: DecodeNode) -> None:
        p = self.prefill[d.node_id]
        running = d.running
        d.running = []
        for req in running:  # decode tokens of this step
            req.intervals.append(self.now - req.last_token_s)
            req.last_token_s = self.now
            req.generated += 1
            d.context += 1
            if req.generated >= req.output_length - 1:
                d.kv_used -= req.kv_tokens
                d.context -= req.input_length + req.generated
                self._finish(req)
            else:
                d.running.append(req)
        job = p.current
        if job is not None:  # the prefill chunk of this step
            req = job
            req.done_tokens += self._chunk_of.pop(d.node_id)
            if self.config.prefix_caching:
                self._store(p, req.keys[: (req.cached_tokens + req.done_tokens) // self.config.block_size])
            if req.done_tokens >= req.computed_tokens:
                if self.config.prefix_caching:
                    self._store(p, req.keys)
                req.first_token_s = req.last_token_s = self.now
                p.current = None
                d.incoming -= 1
                d.incoming_kv -= req.kv_tokens
                d.incoming_context -= req.input_length
                if req.output_length <= 1:
                    self._finish(req)
                else:
                    d.waiting.append(req)
        self._start_step(d)

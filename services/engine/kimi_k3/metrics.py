"""The expert-load metric of a served kimi_k3 model, read at scrape time (nothing per step).

- ``crescent_engine_moe_expert_tokens_total{expert}``: tokens routed to each expert since start,
  summed over the MoE layers (one series per expert: 896 for K3, not layers × experts);
- ``crescent_engine_moe_load_imbalance{layer}``: per MoE layer, the busiest expert's load over
  the mean load (1.0 is perfect balance; quantile-balanced offsets aim there).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crescent.services.common.metrics import MOE_EXPERT_TOKENS, MOE_LOAD_IMBALANCE
from crescent.services.engine.kimi_k3.model import K3Model

EXPERT_TOKENS = MOE_EXPERT_TOKENS
LOAD_IMBALANCE = MOE_LOAD_IMBALANCE


class ExpertLoadCollector(Collector):
    def __init__(self) -> None:
        self._model: weakref.ref[K3Model] | None = None

    def watch(self, model: K3Model) -> None:
        self._model = weakref.ref(model)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        model = self._model() if self._model is not None else None
        if model is None:
            return
        load = model.expert_load()
        tokens = CounterMetricFamily(EXPERT_TOKENS, "Tokens routed to each expert, summed over MoE layers", labels=["expert"])
        for expert, count in enumerate(load.sum(0).tolist()):
            tokens.add_metric([str(expert)], float(count))
        yield tokens
        imbalance = GaugeMetricFamily(LOAD_IMBALANCE, "Busiest expert's load over the mean, per MoE layer", labels=["layer"])
        moe_layers = [i for i in range(model.config.num_layers) if model.config.is_moe_layer(i)]
        for layer, row in zip(moe_layers, load.float()):
            mean = float(row.mean())
            imbalance.add_metric([str(layer)], float(row.max()) / mean if mean else 1.0)
        yield imbalance


_COLLECTOR = ExpertLoadCollector()
_registered: set[int] = set()


def publish_expert_load(model: K3Model, registry: CollectorRegistry = REGISTRY) -> None:
    """Expose ``model``'s expert load on ``registry`` (a process serves one model: the last wins)."""
    _COLLECTOR.watch(model)
    if id(registry) not in _registered:
        registry.register(_COLLECTOR)
        _registered.add(id(registry))

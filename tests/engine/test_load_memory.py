"""Loading a real-format checkpoint never holds the weights twice: peak host memory ≤ ~1.2× the weights.

A multi-shard checkpoint in each real format (Kimi-Linear bf16, K3 with MXFP4 experts whose
``weight_packed``/``weight_scale`` halves sit in different shards) is loaded in a fresh process
by ``loadtest/bench_load_memory.py``'s measurement: the process's peak resident set while loading
(anonymous memory and the memory-mapped shards' pages together) less what it held before, over
the bytes of the weights as the model holds them (the process's second load: its first pays
one-time costs no loader owns). Before tensor-by-tensor loading these were 2.08 (Kimi-Linear:
every shard read, then fp32 copies) and 1.67 (K3); now 1.10 and 1.09 (docs/k3.md, "Loading").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench_load_memory import measure_load, write_checkpoint

BOUND = 1.2


@pytest.mark.slow  # measures a loading process of its own (tests/process_guard.py)
@pytest.mark.parametrize("fmt", ["kimi_linear", "kimi_k3"])
def test_peak_host_memory_while_loading_stays_near_the_weights_bytes(fmt: str, tmp_path: Path) -> None:
    path, _ = write_checkpoint(tmp_path / fmt, fmt, hidden=384, experts=24, vocab=16384, shards=4)
    figures = measure_load(path)
    assert figures["resident_bytes"] > 80e6  # large enough that the interpreter's noise is small beside it
    assert figures["peak_ratio"] <= BOUND, figures
    assert figures["retained_rss_growth"] <= 1.15 * figures["resident_bytes"], figures  # no shard stays mapped

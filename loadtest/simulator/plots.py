"""PNG plots of simulation results (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from loadtest.simulator.report import SimOutcome, Summary


def plot_results(summaries: Sequence[Summary], records: Mapping[str, Sequence[SimOutcome]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    labels = [s.label for s in summaries]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].bar(labels, [s.ttft_avg for s in summaries], color="tab:blue")
    axes[0].set_ylabel("average TTFT (s)")
    axes[1].bar(labels, [s.effective_capacity * 100 for s in summaries], color="tab:green")
    axes[1].set_ylabel("effective requests (%)")
    axes[2].bar(labels, [s.hit_rate * 100 for s in summaries], color="tab:orange")
    axes[2].set_ylabel("cache hit rate (%)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path = out_dir / "summary.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, recs in records.items():
        ttft = np.sort([r.ttft_s for r in recs if r.ttft_s is not None])
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of admitted requests")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "ttft_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written

"""PNG figures of a sweep: effective RPS vs offered load; TTFT and TPOT CDFs at one load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from sglang_ext.sim.metrics import LatencySamples
from sglang_ext.sim.sweep import display_label as _label


def plot_effective_rps(document: Mapping, names: Sequence[str], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        entry = document["policies"][name]
        rates = [load["rate"] for load in entry["loads"]]
        effective = [load["effective_rps"] for load in entry["loads"]]
        ax.plot(rates, effective, marker="o", label=_label(name, entry))
    top = max(document["rates"])
    ax.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="ideal")
    slo = document["scenario"]["slo"]
    ax.set_title(
        f"{document['scenario']['profile']} — SLO TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms"
    )
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("effective RPS (offered × attainment)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency_cdfs(
    document: Mapping, samples: Mapping[str, LatencySamples], names: Sequence[str], path: Path
) -> Path:
    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    slo = document["scenario"]["slo"]
    for name in names:
        if name not in samples:
            continue
        label = _label(name, document["policies"][name])
        for ax, values in ((ttft_ax, samples[name].ttft_ms), (tpot_ax, samples[name].tpot_ms)):
            if values:
                ordered = np.sort(np.asarray(values))
                ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
    for ax, title, target in (
        (ttft_ax, "TTFT (ms)", slo["ttft_ms"]),
        (tpot_ax, "max TPOT per request (ms)", slo["tpot_ms"]),
    ):
        ax.axvline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    ttft_ax.legend(fontsize=8)
    fig.suptitle(f"latency CDFs at {document['cdf_rate']:g} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""PNG figures of a sweep: effective RPS vs offered load; TTFT and TPOT CDFs at one load
(and the end-to-end latency CDF when an SLO class is end-to-end)."""

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
    ax.set_title(f"{document['scenario']['profile']} — SLO {slo_text(document)}")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("effective RPS (offered × attainment)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_classes(document: Mapping) -> dict[str, Mapping]:
    """Targets of the SLO classes the runs' requests had (``scenario.slo.classes``, schema
    2); the default class's when no load names one of them (schema 1)."""
    slo = document["scenario"]["slo"]
    present = {name for entry in document["policies"].values() for load in entry["loads"]
               for name in load.get("by_slo_class", {})}
    classes = {name: targets for name, targets in slo.get("classes", {}).items()
               if name in present}
    return classes or {slo["default_class"]: slo}


def slo_text(document: Mapping) -> str:
    """The SLO targets of the runs' classes in words."""
    classes = run_classes(document)
    return "; ".join(
        (f"{name}: " if len(classes) > 1 else "") + _targets_text(targets)
        for name, targets in classes.items()
    )


def _targets_text(targets: Mapping) -> str:
    if "e2e_ms" in targets:
        return f"e2e {targets['e2e_ms']:g} ms"
    return f"TTFT {targets['ttft_ms']:g} ms, TPOT {targets['tpot_ms']:g} ms"


def _targets(classes: Mapping[str, Mapping], key: str) -> list[float]:
    """The classes' ``key`` targets (TTFT and TPOT: the TTFT+TPOT classes' only)."""
    kind = [t for t in classes.values() if ("e2e_ms" in t) == (key == "e2e_ms")]
    return sorted({t[key] for t in kind})


def plot_latency_cdfs(
    document: Mapping, samples: Mapping[str, LatencySamples], names: Sequence[str], path: Path
) -> Path:
    classes = run_classes(document)
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "max TPOT per request (ms)")]
    if _targets(classes, "e2e_ms"):
        panels.append(("e2e_ms", "end-to-end latency (ms)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5))
    for name in names:
        if name not in samples:
            continue
        label = _label(name, document["policies"][name])
        for ax, (key, _) in zip(axes, panels):
            values = getattr(samples[name], key)
            if values:
                ordered = np.sort(np.asarray(values))
                ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
    for ax, (key, title) in zip(axes, panels):
        for target in _targets(classes, key):
            ax.axvline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"latency CDFs at {document['cdf_rate']:g} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

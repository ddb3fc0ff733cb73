"""PNG figures of a sweep: effective RPS vs offered load; TTFT and TPOT CDFs at one load
(and the end-to-end latency CDF when an SLO class is end-to-end); effective RPS against
the worst prompt-length bucket's attainment (fairness).

Every policy keeps one colour in both figures, none shared (:data:`PALETTE`, in the order
the policies are named); the FairBatching family is drawn solid and everything else
(the baselines, the other seed systems) dashed; a policy with admission control (its own
``+MODE``, a ``-pab`` name, vLLM's queued-token cap, SGLang's waiting timeout) carries
markers. The legend sits outside the data, to the right.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from sglang_ext.sim.metrics import LatencySamples
from sglang_ext.sim.sweep import display_label as _label
from sglang_ext.sim.sweep import policy_kind

#: one colour per policy: tab10, then dark and saturated ones unlike it (no light tints,
#: which vanish on white), then tab20's tints; past them a colour repeats
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#000000", "#f032e6", "#0000cd", "#b8860b", "#800000", "#469990",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">")
LEGEND_TITLE = "solid: FairBatching\ndashed: the others\nmarkers: admission control"


def policy_styles(names: Sequence[str]) -> dict[str, dict]:
    """Line keyword arguments per policy: its own colour, solid for the FairBatching family
    and dashed otherwise, a marker when it has admission control."""
    styles = {}
    markers = iter(MARKERS * len(names))
    for index, name in enumerate(dict.fromkeys(names)):
        fairbatching, admission = policy_kind(name)
        style = {"color": PALETTE[index % len(PALETTE)], "linestyle": "-" if fairbatching else "--",
                 "linewidth": 1.8 if fairbatching else 1.5}
        if admission:
            style.update(marker=next(markers), markersize=5)
        styles[name] = style
    return styles


def effective_rps_figure(document: Mapping, names: Sequence[str]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(10, 5), layout="constrained")
    styles = policy_styles(names)
    for name in names:
        entry = document["policies"][name]
        rates = [load["rate"] for load in entry["loads"]]
        effective = [load["effective_rps"] for load in entry["loads"]]
        ax.plot(rates, effective, label=_label(name, entry), **styles[name])
    top = max(document["rates"])
    ax.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="ideal")
    ax.set_title(f"{document['scenario']['profile']} — SLO {slo_text(document)}")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("effective RPS (offered × attainment)")
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    return fig


def plot_effective_rps(document: Mapping, names: Sequence[str], path: Path) -> Path:
    return save_figure(effective_rps_figure(document, names), path)


def fairness_figure(document: Mapping, names: Sequence[str]) -> plt.Figure:
    """Effective RPS against the worst prompt-length bucket's attainment, one point per load,
    joined in load order (the first load's point ringed): throughput bought at whose
    expense. A load without a worst bucket (no bucket large enough) is left out."""
    fig, ax = plt.subplots(figsize=(10, 5), layout="constrained")
    styles = policy_styles(names)
    for name in names:
        entry = document["policies"][name]
        points = [(load["worst_prompt_bucket"]["attainment"], load["effective_rps"])
                  for load in entry["loads"]
                  if (load.get("worst_prompt_bucket") or {}).get("attainment") is not None]
        if not points:
            continue
        style = dict(styles[name])
        style.setdefault("marker", ".")
        style.setdefault("markersize", 5)
        xs, ys = zip(*points)
        ax.plot(xs, ys, label=_label(name, entry), **style)
        ax.plot(xs[:1], ys[:1], marker="o", markersize=9, markerfacecolor="none",
                markeredgecolor=style["color"], linestyle="none")
    minimum = next((load["worst_prompt_bucket"]["min_requests"]
                    for entry in document["policies"].values() for load in entry["loads"]
                    if "worst_prompt_bucket" in load), None)
    ax.set_title(f"{document['scenario']['profile']} — SLO {slo_text(document)}\n"
                 "effective RPS against worst-bucket attainment, per load (ringed: the lowest)",
                 fontsize=10)
    ax.set_xlabel("SLO attainment of the worst prompt-length bucket"
                  + (f" (buckets of >= {minimum} requests)" if minimum else ""))
    ax.set_ylabel("effective RPS (offered × attainment)")
    ax.set_xlim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    return fig


def plot_fairness(document: Mapping, names: Sequence[str], path: Path) -> Path:
    return save_figure(fairness_figure(document, names), path)


def demo_figure(cases: Sequence[tuple[str, Mapping, Sequence[str], str]],
                labels: Mapping[str, str]) -> plt.Figure:
    """The demo's one figure: per case (its title, sweep document, policies and the worst
    group it follows, ``worst_prompt_bucket`` or ``worst_slo_class``), effective RPS against
    load above and that group's attainment against load below; ``labels`` name the lines."""
    fig, axes = plt.subplots(2, len(cases), figsize=(5.5 * len(cases) + 2.5, 8),
                             layout="constrained", squeeze=False)
    names = list(dict.fromkeys(name for _, _, case_names, _ in cases for name in case_names))
    styles = policy_styles(names)
    group_words = {"worst_prompt_bucket": "worst prompt-length bucket",
                   "worst_slo_class": "worst SLO class"}
    for column, (title, document, case_names, group) in enumerate(cases):
        top, bottom = axes[0][column], axes[1][column]
        for name in case_names:
            entry = document["policies"][name]
            style = styles[name]
            rates = [load["rate"] for load in entry["loads"]]
            top.plot(rates, [load["effective_rps"] for load in entry["loads"]],
                     label=labels.get(name, name), **style)
            points = [(load["rate"], load[group]["attainment"]) for load in entry["loads"]
                      if (load.get(group) or {}).get("attainment") is not None]
            if points:
                bottom.plot(*zip(*points), **style)
        highest = max(document["rates"])
        top.plot([0, highest], [0, highest], color="grey", linestyle=":", linewidth=1)
        top.set_title(title)
        top.set_ylabel("effective RPS (offered × attainment)")
        bottom.set_ylabel(f"on time, {group_words[group]}")
        bottom.set_ylim(-0.02, 1.02)
        bottom.set_xlabel("offered load (req/s)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    legend: dict[str, object] = {}
    for ax in axes[0]:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(text, handle)
    fig.legend(list(legend.values()), list(legend), loc="outside right upper", fontsize=8, title=LEGEND_TITLE,
               title_fontsize=7, alignment="left")
    return fig


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


def latency_cdf_figure(
    document: Mapping, samples: Mapping[str, LatencySamples], names: Sequence[str]
) -> plt.Figure:
    classes = run_classes(document)
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "max TPOT per request (ms)")]
    if _targets(classes, "e2e_ms"):
        panels.append(("e2e_ms", "end-to-end latency (ms)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 3, 4.5),
                             layout="constrained")
    styles = policy_styles(names)
    for name in names:
        if name not in samples:
            continue
        label = _label(name, document["policies"][name])
        for ax, (key, _) in zip(axes, panels):
            values = getattr(samples[name], key)
            if values:
                ordered = np.sort(np.asarray(values))
                ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label,
                        markevery=0.1, **styles[name])
    for ax, (key, title) in zip(axes, panels):
        for target in _targets(classes, key):
            ax.axvline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8, title=LEGEND_TITLE,
               title_fontsize=7, alignment="left")
    fig.suptitle(f"latency CDFs at {document['cdf_rate']:g} req/s")
    return fig


def plot_latency_cdfs(
    document: Mapping, samples: Mapping[str, LatencySamples], names: Sequence[str], path: Path
) -> Path:
    return save_figure(latency_cdf_figure(document, samples, names), path)


def save_figure(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _legend_outside(ax: plt.Axes) -> None:
    """The legend right of the data, so no curve is hidden behind it."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8,
              title=LEGEND_TITLE, title_fontsize=7, alignment="left")

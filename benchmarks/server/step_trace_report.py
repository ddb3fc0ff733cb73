"""Where the time between two tokens goes: a summary of a FairBatching step log.

Reads the per-step log a scheduler writes with ``[trace] step_log`` in the extension's
config (:mod:`sglang_ext.adapter.scheduler.step_trace`) and, optionally, the client's token
arrival times (``python -m benchmarks.server.trace_replay --token-times``; same machine, same
clock)::

    python -m benchmarks.server.step_trace_report --steps steps.jsonl [--tokens tokens.jsonl] \\
        [--json out.json]

Per step: the step period (one processed result to the next: what a decode riding every
step sees), the device time measured and predicted, the host time the overlap loop did
not hide (period - device), the adapter's decision time, SGLang's output processing, and
the lag of each token behind the policy's plan (emitted - planned start - predicted).
Per token, with the client's times: delivery (client arrival - the step's processed
time), and for each request's longest gap and each late token, how much of it was
parked steps, the producing step, and delivery.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.support.paths import REPO
from sglang_ext.adapter.scheduler.step_trace import read_step_log

QUANTILES = (0.5, 0.9, 0.99)


def quantiles_ms(values: Iterable[float], scale: float = 1e3) -> dict[str, float] | None:
    """p50/p90/p99/mean of seconds, in milliseconds (or another ``scale``), and the count."""
    ordered = sorted(values)
    if not ordered:
        return None
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    summary = {f"p{round(q * 100)}": round(pick(q) * scale, 2) for q in QUANTILES}
    summary["mean"] = round(sum(ordered) / len(ordered) * scale, 2)
    summary["n"] = len(ordered)
    return summary


def step_summary(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    periods, device, host, decision, processing, lag, errors = [], [], [], [], [], [], []
    overruns = budgeted = 0
    previous = None
    for step in steps:
        if previous is not None:
            period = step["processed_at"] - previous["processed_at"]
            periods.append(period)
            if step["device_s"] is not None:
                host.append(max(0.0, period - step["device_s"]))
        previous = step
        processing.append(step["processed_at"] - step["done_at"])
        if step["device_s"] is not None:
            device.append(step["device_s"])
            if step["predicted_s"] > 0:
                errors.append(abs(step["device_s"] - step["predicted_s"]) / step["predicted_s"])
        if step["decision_s"] is not None:
            decision.append(step["decision_s"])
            lag.append(step["processed_at"] - step["planned_start"] - step["predicted_s"])
        if step["budget_s"] is not None and step["device_s"] is not None:
            budgeted += 1
            overruns += step["device_s"] > step["budget_s"]
    return {
        "steps": len(steps),
        "period_ms": quantiles_ms(periods),
        "device_ms": quantiles_ms(device),
        "host_unhidden_ms": quantiles_ms(host),
        "decision_ms": quantiles_ms(decision),
        "output_processing_ms": quantiles_ms(processing),
        "emission_lag_behind_plan_ms": quantiles_ms(lag),
        "step_model_abs_relative_error_pct": quantiles_ms(errors, scale=100.0),
        "budget_overruns": {"overran": overruns, "of": budgeted},
        "steps_with_parked": sum(1 for step in steps if step["parked"]),
        "parked_per_step_mean": (sum(len(step["parked"]) for step in steps) / len(steps)) if steps else 0.0,
    }


def emissions(steps: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, int, float | None]]]:
    """Per rid, the step index that produced each of its tokens, with that token's
    decision-time deadline: ``[(step_position, token_index, deadline), ...]``."""
    produced: dict[str, int] = defaultdict(int)
    out: dict[str, list[tuple[int, int, float | None]]] = defaultdict(list)
    for position, step in enumerate(steps):
        for rid, count, deadline in step["tokens"]:
            while produced[rid] < count:
                out[rid].append((position, produced[rid], deadline))
                produced[rid] += 1
    return out


def parked_positions(steps: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for position, step in enumerate(steps):
        for rid in step["parked"]:
            out[rid].append(position)
    return out


def token_summary(steps: Sequence[dict[str, Any]], clients: Sequence[dict[str, Any]],
                  tpot_s_of: dict[str, float]) -> dict[str, Any]:
    produced = emissions(steps)
    parked = parked_positions(steps)
    delivery, server_late, client_late = [], [], []
    longest_parts: dict[str, list[float]] = defaultdict(list)
    violations = {"requests": 0, "parked_before": 0, "server_emitted_late": 0}
    for client in clients:
        rid, arrivals = client["rid"], client["tokens"]
        emitted = produced.get(rid, [])
        if len(emitted) < len(arrivals) or not arrivals:
            continue
        tpot = tpot_s_of.get(client["slo_class"])
        server_times = [steps[position]["processed_at"] for position, _, _ in emitted[: len(arrivals)]]
        delivery.extend(arrival - server for arrival, server in zip(arrivals, server_times))
        for (position, _, deadline), server in zip(emitted[1:], server_times[1:]):
            if deadline is not None:
                server_late.append(server - deadline)
        if len(arrivals) < 2:
            continue
        gaps = [(arrivals[j] - arrivals[j - 1], j) for j in range(1, len(arrivals))]
        gap, j = max(gaps)
        first, last = emitted[j - 1][0], emitted[j][0]
        parked_steps = [p for p in parked.get(rid, []) if first < p < last]
        parked_s = sum(steps[p]["processed_at"] - steps[p - 1]["processed_at"] for p in parked_steps)
        ran_s = server_times[j] - server_times[j - 1] - parked_s
        longest_parts["gap"].append(gap)
        longest_parts["parked"].append(parked_s)
        longest_parts["steps_between"].append(max(0.0, ran_s))
        longest_parts["delivery_delta"].append(gap - (server_times[j] - server_times[j - 1]))
        if tpot is None:
            continue
        worst = max(range(1, len(arrivals)), key=lambda k: (arrivals[k] - arrivals[0]) / k)
        if (arrivals[worst] - arrivals[0]) / worst > tpot:
            violations["requests"] += 1
            client_late.append((arrivals[worst] - arrivals[0]) / worst - tpot)
            if any(p < emitted[worst][0] for p in parked.get(rid, [])):
                violations["parked_before"] += 1
            server_tpot = (server_times[worst] - server_times[0]) / worst
            if server_tpot > tpot:
                violations["server_emitted_late"] += 1
    return {
        "requests_joined": len(longest_parts["gap"]),
        "delivery_ms": quantiles_ms(delivery),
        "emitted_minus_deadline_ms": quantiles_ms(server_late),
        "longest_gap_ms": {part: quantiles_ms(values) for part, values in longest_parts.items()},
        "max_tpot_violations": violations,
        "max_tpot_excess_ms": quantiles_ms(client_late),
    }


def _row(name: str, summary: dict[str, float] | None, unit: str = "ms") -> str:
    if not summary:
        return f"| {name} | - | - | - | - | 0 |"
    cells = " | ".join(f"{summary[key]:.2f}" for key in ("p50", "p90", "p99", "mean"))
    return f"| {name} ({unit}) | {cells} | {summary['n']} |"


def _table_head(what: str) -> tuple[str, str]:
    return f"| {what} | p50 | p90 | p99 | mean | n |", "|---|---:|---:|---:|---:|---:|"


def render(report: dict[str, Any]) -> str:
    steps = report["steps"]
    lines = [
        f"Steps: {steps['steps']}; with parked decodes: {steps['steps_with_parked']} "
        f"(mean {steps['parked_per_step_mean']:.1f} parked per step); budget overruns "
        f"{steps['budget_overruns']['overran']} of {steps['budget_overruns']['of']}.",
        "",
        *_table_head("per step"),
        _row("period: processed result to processed result", steps["period_ms"]),
        _row("device, measured", steps["device_ms"]),
        _row("host not hidden by overlap (period - device)", steps["host_unhidden_ms"]),
        _row("adapter + policy decision", steps["decision_ms"]),
        _row("SGLang output processing", steps["output_processing_ms"]),
        _row("emission lag behind plan (processed - planned start - predicted)",
             steps["emission_lag_behind_plan_ms"]),
        _row("step model |error| / predicted", steps["step_model_abs_relative_error_pct"], "%"),
    ]
    tokens = report.get("tokens")
    if tokens:
        violations = tokens["max_tpot_violations"]
        lines += [
            "",
            f"Requests joined with the client: {tokens['requests_joined']}; max-TPOT violations: "
            f"{violations['requests']} (a parked step before the worst token: "
            f"{violations['parked_before']}; already late as emitted by the server: "
            f"{violations['server_emitted_late']}).",
            "",
            *_table_head("per token / per request"),
            _row("delivery: client arrival - processed", tokens["delivery_ms"]),
            _row("server emission - deadline at decision", tokens["emitted_minus_deadline_ms"]),
            _row("max-TPOT excess over target (violations)", tokens["max_tpot_excess_ms"]),
        ]
        for part, summary in tokens["longest_gap_ms"].items():
            lines.append(_row(f"longest gap per request: {part}", summary))
    return "\n".join(lines)


def load_clients(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def build_report(steps_path: Path, tokens_path: Path | None, slo_file: Path | None) -> dict[str, Any]:
    steps = read_step_log(steps_path)
    report: dict[str, Any] = {"steps": step_summary(steps)}
    if tokens_path is not None:
        from sglang_ext.policy.slo import SloCatalog

        catalog = SloCatalog.from_toml(slo_file or REPO / "configs" / "slo.toml")
        tpot = {name: slo.tpot_s for name, slo in catalog.classes.items()}
        report["tokens"] = token_summary(steps, load_clients(tokens_path), tpot)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=Path, required=True, help="the server's [trace] step_log")
    parser.add_argument("--tokens", type=Path, help="the replay's --token-times file")
    parser.add_argument("--slo-file", type=Path, help="SLO classes of the replay (default configs/slo.toml)")
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")
    args = parser.parse_args(argv)
    for path in (args.steps, args.tokens):
        if path is not None and not path.is_file():
            print(f"error: {path} does not exist", file=sys.stderr)
            return 2
    report = build_report(args.steps, args.tokens, args.slo_file)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

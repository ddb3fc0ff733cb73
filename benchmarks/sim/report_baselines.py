"""Which of the simulator's baselines the report's ratios divide by."""

from __future__ import annotations

from sglang_ext.sim.sweep import ADMISSION_BASELINES, BASELINES

#: the baselines without admission control: their best's peak is the knee of the load axis
NO_ADMISSION = tuple(name for name in BASELINES if name not in ADMISSION_BASELINES)


def best_without_admission(policies: dict) -> tuple[str, dict]:
    """The baseline without admission control with the highest peak effective RPS."""
    name = max(NO_ADMISSION, key=lambda n: policies[n]["peak_effective_rps"])
    return name, policies[name]

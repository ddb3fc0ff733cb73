"""The unfamiliar-GPU benchmarks' choice of SGLang's settings: one per family, the best
mean, its neighbours spanning the tuned timeout, and an end of an axis named."""

from __future__ import annotations

import benchmarks.sim.unfamiliar_gpu_capacity as capacity
import benchmarks.sim.unfamiliar_gpu_seeds as seeds


def test_the_timeout_neighbours_span_the_tuned_one() -> None:
    specs = seeds._timeout_neighbours("sarathi-hrrn-queue-timeout@256,timeout=1.25")
    assert specs == [*(f"sarathi-hrrn-queue-timeout@256,timeout={t:g}" for t in (0.1562, 0.3125, 0.625, 1.25, 2.5, 5, 10)),
                     "sarathi-hrrn@256"]


def test_one_setting_per_family_the_best_mean_over_loads_and_seeds() -> None:
    def run(attainments: dict[str, list[float]]) -> dict:
        return {spec: {"loads": [{"attainment": a} for a in values]} for spec, values in attainments.items()}

    # "b" wins one load of one seed by a lot; "a" is better on the mean of every point
    runs = [run({"a": [0.9, 0.8], "b": [0.95, 0.5]}), run({"a": [0.9, 0.8], "b": [0.7, 0.6]})]
    assert seeds._best_setting(runs, ["a", "b"]) == "a"


def test_capacity_tuning_names_a_choice_at_an_axis_end() -> None:
    spec = "sarathi-spf-queue-timeout@256,timeout=1"
    listed = capacity.candidates(spec)
    assert len(listed) == len(capacity.TUNE_BUDGETS) * len(capacity.TUNE_TIMEOUT_FACTORS)

    def grid(best: str) -> dict:
        entries = {}
        for candidate in listed:
            worst = 2.0 if candidate == best else 1.0
            entries[candidate] = {"capacity": {capacity.TARGET: {
                "worst_slo_class": {"capacity": worst}, "overall": {"capacity": 3.0}}},
                "loads": [{"attainment": 0.5}]}
        return entries

    interior = "sarathi-spf-queue-timeout@256,timeout=4"
    chosen = capacity.choose(grid(interior), {"sarathi-spf-queue-timeout": spec})["sarathi-spf-queue-timeout"]
    assert chosen["chosen"] == interior and chosen["edge"] == []
    corner = "sarathi-spf-queue-timeout@512,timeout=16"
    chosen = capacity.choose(grid(corner), {"sarathi-spf-queue-timeout": spec})["sarathi-spf-queue-timeout"]
    assert chosen["chosen"] == corner and chosen["edge"] == ["budget", "timeout"]

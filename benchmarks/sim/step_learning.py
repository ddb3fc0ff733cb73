"""Benchmark: how fast the online step model learns a device it was not fitted to.

Each *device* is a simulated GPU (every roofline profile in ``configs/profiles/``, noise
and stalls included) or the measured H100 grid (``../shared/data/gpu/``, its rows
streamed as a server meets them). Each device is driven through a serving-like stream
of steps: decode-only stretches of 4-12 steps over 1-128 requests, each followed by 1-4
prefill or mixed steps (chunks of 16-4,096 tokens, some after a cached prefix, most
beside the decodes). The online model starts from each shipped step-model file in
turn, the device's own included, predicts each step before it sees the measured time,
and learns from it. Reported: the median |relative error| over the steps after the
first 200, overall and per kind of step (decode-only, mixed, prefill-heavy), and over
steps 4-50 (the first seconds of serving), for the learner the policies run (the knee
learned online, ``OnlineKneeModel``), for that learner inside the shipped policy (which
also checks the device's speed over its first steps, ``sglang_ext.policy.speed_probe``)
and for the knee frozen at the file's value (``learn_knee = false``). Target: within 5%
from every starting file. From the repository root::

    python -m benchmarks.sim.step_learning            # writes docs/bench/step_learning.{md,json}
    python -m benchmarks.sim.step_learning --no-write
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import DOCS_BENCH, REPO
from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.slo import Slo
from sglang_ext.policy.step_error import STEP_KINDS, step_kind
from sglang_ext.policy.step_model import StepModelFile, StepPredictor, online_step_model
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.variants import VARIANTS  # noqa: F401  registers the shipped policy
from sglang_ext.provenance import git_state
from sglang_ext.sim.fitting.predictor_check import serving_order, synthetic_serving_stream
from sglang_ext.sim.fitting.step_grid import read_grid
from sglang_ext.sim.profile import load_profile
from sglang_ext.sim.service_curve import make_gpu

STEP_MODELS = REPO / "configs" / "step_models"
PROFILES = REPO / "configs" / "profiles"
MEASURED_GRID = REPO.parent / "shared" / "data" / "gpu" / "llama3.1-8b-h100.csv"
WARMUP_STEPS = 200
#: the first steps scored: from the fourth (the speed check needs three) to the 50th
FIRST_STEPS = (3, 50)
STEPS = 800
TARGET = 0.05
SHIPPED = "fb-smooth"
#: row label -> (the knee learned online, the learner inside the shipped policy)
LEARNERS = {"learned knee": (True, False), f"learned knee in {SHIPPED}": (True, True),
            "frozen knee": (False, False)}


@dataclass(frozen=True)
class Device:
    name: str
    steps: Callable[[int], Iterator[tuple[StepShape, float]]]  # seed -> (shape, measured s)


def profile_device(path: Path) -> Device:
    profile = load_profile(path)

    def steps(seed: int) -> Iterator[tuple[StepShape, float]]:
        gpu = make_gpu(profile, seed)
        for shape in synthetic_serving_stream(seed, STEPS):
            yield shape, gpu.measure_step_s(shape)

    return Device(profile.name, steps)


def grid_device(path: Path) -> Device:
    rows = read_grid(path)

    def steps(seed: int) -> Iterator[tuple[StepShape, float]]:
        streamed = 0
        while streamed < STEPS:
            for row in serving_order(rows, seed + streamed):
                yield row.shape, row.seconds
            streamed += len(rows)

    return Device(f"{path.stem} (measured grid)", steps)


def devices() -> list[Device]:
    found = [profile_device(path) for path in sorted(PROFILES.glob("*.toml"))
             if load_profile(path).service is None]
    if MEASURED_GRID.is_file():
        found.append(grid_device(MEASURED_GRID))
    return found


def starting_files() -> dict[str, StepPredictor]:
    return {path.stem: StepModelFile.load(path).model for path in sorted(STEP_MODELS.glob("*.toml"))}


class _Learner:
    """The online model alone, or inside the shipped policy (``in_policy``): what
    predicts the next step and what learns from it."""

    def __init__(self, start: StepPredictor, learn_knee: bool, in_policy: bool) -> None:
        self.policy = None
        if in_policy:
            context = PolicyContext(Slo(ttft_s=2.0, tpot_s=0.05), start, learn_knee=learn_knee)
            self.policy = POLICIES.get(SHIPPED)(context)
        else:
            self.model = online_step_model(start, learn_knee=learn_knee)

    def observe(self, shape: StepShape, measured: float) -> float:
        """The step's |relative error| as predicted before it is learned."""
        if self.policy is None:
            return abs(self.model.observe(shape, measured))
        predicted = self.policy.step_model.coefficients.predict_step(shape)
        self.policy.observe_step(shape, measured)
        return abs(measured - predicted) / measured

    @property
    def coefficients(self) -> StepPredictor:
        return (self.model if self.policy is None else self.policy.step_model).coefficients


def learn(device: Device, start: StepPredictor, learn_knee: bool, seed: int,
          in_policy: bool = False) -> dict:
    learner = _Learner(start, learn_knee, in_policy)
    errors: dict[str, list[float]] = {"all": [], **{kind: [] for kind in STEP_KINDS}}
    first: list[float] = []
    for index, (shape, measured) in enumerate(device.steps(seed)):
        if index >= STEPS:
            break
        error = learner.observe(shape, measured)
        if FIRST_STEPS[0] <= index < FIRST_STEPS[1]:
            first.append(error)
        if index >= WARMUP_STEPS:
            errors["all"].append(error)
            errors[step_kind(shape)].append(error)
    learned = learner.coefficients
    return {
        "median_abs_error": {kind: statistics.median(values) if values else None
                             for kind, values in errors.items()},
        "first_steps_median_abs_error": statistics.median(first),
        "steps_scored": len(errors["all"]),
        "learned": {"form": learned.form, **learned.fields()},
    }


def run(seed: int) -> dict:
    files = starting_files()
    results = []
    for device in devices():
        for start_name, start in files.items():
            for learner, (learn_knee, in_policy) in LEARNERS.items():
                outcome = learn(device, start, learn_knee, seed, in_policy)
                results.append({"device": device.name, "start": start_name, "learner": learner,
                                **outcome})
    return {"seed": seed, "warmup_steps": WARMUP_STEPS, "first_steps": list(FIRST_STEPS),
            "steps": STEPS, "target": TARGET, "results": results}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def render(doc: dict) -> str:
    lines = [
        "# How fast the step model learns a device",
        "",
        (f"Median |relative error| of each step's prediction over steps {doc['warmup_steps'] + 1}-"
         f"{doc['steps']} of a serving-like stream (seed {doc['seed']}), from each shipped "
         f"step-model file; target within {doc['target'] * 100:.0f}%. `first steps`: the "
         f"same over steps {doc['first_steps'][0] + 1}-{doc['first_steps'][1]}. "
         f"`in {SHIPPED}`: the learner inside the shipped policy, which also checks the "
         "device's speed against the file over its first steps. "
         "`python -m benchmarks.sim.step_learning`."),
        "",
        ("| device | starting file | learner | all | decode | mixed | prefill | first steps "
         "| learned knee |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in doc["results"]:
        errors = row["median_abs_error"]
        knee = row["learned"].get("knee_tokens")
        lines.append(
            f"| {row['device']} | {row['start']} | {row['learner']} | **{_pct(errors['all'])}** | "
            f"{_pct(errors['decode'])} | {_pct(errors['mixed'])} | {_pct(errors['prefill'])} | "
            f"{_pct(row['first_steps_median_abs_error'])} | "
            f"{'-' if knee is None else f'{knee:.0f}'} |")
    learned = [r for r in doc["results"] if r["learner"] == "learned knee"]
    foreign = [r for r in learned if not r["device"].startswith(r["start"])]
    worst = max(foreign, key=lambda r: r["median_abs_error"]["all"])
    met = sum(r["median_abs_error"]["all"] <= doc["target"] for r in foreign)
    lines += [
        "",
        (f"From another device's file, the learned knee is within the target in {met} of "
         f"{len(foreign)} pairs; the worst is {_pct(worst['median_abs_error']['all'])} "
         f"({worst['device']} from {worst['start']})."),
    ]
    shipped = {(r["device"], r["start"]): r for r in doc["results"]
               if r["learner"] == f"learned knee in {SHIPPED}"}
    if shipped:
        def first(rows: list[dict]) -> str:
            values = sorted(r["first_steps_median_abs_error"] for r in rows)
            return f"{_pct(statistics.median(values))} (worst {_pct(values[-1])})"

        in_policy = [shipped[(r["device"], r["start"])] for r in foreign]
        lines.append(
            f"Over the first steps from another device's file, the median of the pairs' "
            f"errors is {first(foreign)} for the learner alone and {first(in_policy)} inside "
            f"{SHIPPED}.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DOCS_BENCH)
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    started = time.monotonic()
    doc = run(args.seed)
    doc["provenance"] = {**git_state(REPO), "wall_s": round(time.monotonic() - started, 1),
                         "command": "python -m benchmarks.sim.step_learning"}
    text = render(doc)
    print(text)
    if not args.no_write:
        write_outputs(args.out, "step_learning", text, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

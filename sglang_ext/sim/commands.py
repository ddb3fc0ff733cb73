"""``python -m sglang_ext.sim {run,sweep,capacity,cluster,calibrate}`` — see ``--help`` of each."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from controlplane.balancer import BALANCERS
from controlplane.cli_args import (
    non_negative_float, non_negative_int, positive_float, positive_int, refuse_repeats,
)
from controlplane.retry import DEFAULT_MAX_RETRIES
from sglang_ext.policy.admission import AdmissionSettings
from sglang_ext.policy.policies import POLICIES
from sglang_ext.policy.slo import SloCatalog, SloError
from sglang_ext.policy.step_model import STEP_FORMS, StepModelError, StepModelFile
from sglang_ext.provenance import git_commit
from sglang_ext.sim import capacity, demo, sweep_modes
from sglang_ext.sim.cluster import (
    DEFAULT_MAX_QUEUED,
    DEFAULT_QUEUE_TTL_S,
    DEFAULT_REPORT_DELAY_S,
    ON_NO_BUDGET,
    ClusterConfig,
    ClusterConfigError,
    simulate_cluster,
)
from sglang_ext.sim.disagg import (
    DEFAULT_LINK_GBPS,
    DEFAULT_SPLIT,
    DisaggConfig,
    DisaggConfigError,
)
from sglang_ext.sim.executors import (
    EXECUTORS,
    ExecutorError,
    ExecutorSpec,
    check_available,
    open_pool,
)
from sglang_ext.sim.fitting.calibration import offline_step_model, profile_steps
from sglang_ext.sim.fitting.grid_fit import fit_grid, read_grid_meta
from sglang_ext.sim.fitting.predictor_check import DEFAULT_WARMUP, as_json, check_predictors, render
from sglang_ext.sim.fitting.profile_fit import fitted_profile_toml
from sglang_ext.sim.fitting.step_grid import GridError, read_grid
from sglang_ext.sim.metrics import MIN_GROUP_REQUESTS, worst_group
from sglang_ext.sim.profile import (
    PROFILES_DIR,
    HardwareProfile,
    ProfileError,
    available_profiles,
    bundled_profile_path,
    load_profile,
)
from sglang_ext.sim.runner import (
    DEFAULT_TOKEN_BUDGETS,
    PolicySpec,
    PolicySpecError,
    RunResult,
    Scenario,
    build_policy,
    parse_admission,
    parse_policy,
    simulate,
)
from sglang_ext.sim.sweep import (
    DEFAULT_POLICIES,
    PRIORITY_BASELINES,
    SweepPlan,
    assemble,
    default_policies,
    plan_sweep,
    run_sweep,
    summary_table,
    write_results,
)
from sglang_ext.sim.tuned import (
    TunedSettingsError,
    display_path,
    scenario_fingerprint,
    settings_toml,
)
from sglang_ext.sim.tuned import load as tuned_load
from sglang_ext.sim.workloads import (
    FORMATS,
    ClassMix,
    Workload,
    WorkloadError,
    bundled_sample,
    load_workload,
    parse_arrivals,
)

DEFAULT_SLO_CONFIG = PROFILES_DIR.parent / "slo.toml"
DEFAULT_PROFILE = "llama3.1-8b-h100"
DEFAULT_SAMPLE_HEAD_S = 300.0
DEFAULT_RATES = (4.0, 8.0, 12.0, 14.0, 16.0, 17.0, 18.0, 19.0, 20.0, 22.0, 24.0, 28.0, 32.0, 36.0)
#: the quick sweep's loads: the full grid less 17, 18 and 22 (sglang_ext.sim.sweep_modes)
QUICK_RATES = (4.0, 8.0, 12.0, 14.0, 16.0, 19.0, 20.0, 24.0, 28.0, 32.0, 36.0)
EXIT_USAGE = 2


class CliError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _rate_list(text: str) -> tuple[float, ...]:
    rates = tuple(positive_float(part) for part in text.split(",") if part.strip())
    if not rates:
        raise argparse.ArgumentTypeError("expected comma-separated rates, e.g. 2,4,8")
    return tuple(sorted(set(rates)))


def _budget_list(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not budgets or budgets[0] < 1:
        raise argparse.ArgumentTypeError("token budgets must be integers >= 1")
    return budgets


def _target(text: str) -> float:
    value = positive_float(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"a share of requests in (0, 1], got {text!r}")
    return value


def _arrivals(text: str) -> str:
    try:
        parse_arrivals(text)
    except WorkloadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _class_mix(text: str) -> ClassMix:
    try:
        return ClassMix.parse(text)
    except WorkloadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _admission(text: str) -> AdmissionSettings:
    try:
        return parse_admission(text)
    except PolicySpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_admission(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admission", type=_admission, metavar="MODE[:RULE]",
        help="admission control of every FairBatching-family policy named without its own "
        "+MODE: reject, defer or reject:pab (sglang_ext.policy.admission); the baselines keep "
        "theirs (sarathi-queue-cap, sarathi-queue-timeout and their -sjf- and -priority- "
        "orders)",
    )


def _split(text: str) -> tuple[int, int]:
    try:
        return DisaggConfig.parse_split(text)
    except DisaggConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_disagg(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "disaggregated policies (kairos, kairos-fcfs, kairos-online; sglang_ext.sim.disagg)"
    )
    group.add_argument(
        "--split", type=_split, metavar="P:D",
        help="prefill and decode ranks, one GPU each (default: 1:1)",
    )
    group.add_argument(
        "--link-gbps", type=positive_float, metavar="GBPS",
        help=f"each prefill rank's KV-transfer link, Gb/s (default: {DEFAULT_LINK_GBPS:g})",
    )


def _disagg_config(args: argparse.Namespace, specs: Sequence[PolicySpec]) -> DisaggConfig:
    """``--split`` / ``--link-gbps``, refused unless a disaggregated policy is named."""
    given = [flag for flag, value in (("--split", args.split), ("--link-gbps", args.link_gbps))
             if value is not None]
    if given and not any(POLICIES.get(spec.base).disaggregated for spec in specs):
        names = ", ".join(spec.label for spec in specs)
        raise CliError(
            f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to "
            "disaggregated policies "
            f"({', '.join(_disaggregated_names())}); {names} run colocated"
        )
    prefill, decode = args.split or DEFAULT_SPLIT
    return DisaggConfig(prefill, decode, args.link_gbps or DEFAULT_LINK_GBPS)


def _disaggregated_names() -> list[str]:
    return [name for name in POLICIES.names() if POLICIES.get(name).disaggregated]


def _add_executor(parser: argparse.ArgumentParser, jobs_help: str) -> None:
    group = parser.add_argument_group("where the simulations run (sglang_ext.sim.executors)")
    group.add_argument("--jobs", type=int, help=jobs_help)
    group.add_argument(
        "--executor", choices=EXECUTORS, default="process",
        help="process: worker processes on this machine; ray: tasks on a Ray cluster (the "
        "`ray` extra), the same results (default: %(default)s)",
    )
    group.add_argument(
        "--ray-address", metavar="ADDRESS",
        help="the Ray cluster to run on (as ray.init's address: auto, HOST:PORT, "
        "ray://HOST:PORT); default: RAY_ADDRESS when set, else a local instance of --jobs CPUs",
    )


def _executor_spec(args: argparse.Namespace) -> ExecutorSpec:
    """``--executor`` / ``--ray-address``, refused now if they cannot run here."""
    spec = ExecutorSpec(args.executor, args.ray_address)
    check_available(spec)
    return spec


def _common(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload")
    workload.add_argument("--trace", type=Path, help="trace file (default: the bundled Azure sample)")
    workload.add_argument("--format", choices=FORMATS, default="azure", help="trace format")
    workload.add_argument(
        "--arrivals", type=_arrivals, default="trace",
        help="trace (scaled trace times), poisson, or gamma:CV (bursty)",
    )
    workload.add_argument(
        "--head-seconds", type=positive_float,
        help=f"keep the first S seconds of the trace (default: {DEFAULT_SAMPLE_HEAD_S:g} for the "
        "bundled sample, all of a given trace)",
    )
    workload.add_argument(
        "--skip-seconds", type=non_negative_float,
        help="drop the trace's first S seconds before --head-seconds, for a later window "
        "(e.g. --skip-seconds 1500 --head-seconds 300 of the shared 1-hour Azure trace)",
    )
    workload.add_argument(
        "--class-mix", type=_class_mix, metavar="NAME:FRACTION,...",
        help="assign each request an SLO class of --slo-config, drawn with --seed "
        "(e.g. interactive:0.2,standard:0.5,relaxed:0.3); default: every request in the "
        "default class",
    )
    system = parser.add_argument_group("system")
    system.add_argument(
        "--profile", default=DEFAULT_PROFILE,
        help=f"GPU profile: a bundled name ({', '.join(available_profiles())}) or a TOML path",
    )
    system.add_argument("--slo-config", type=Path, default=DEFAULT_SLO_CONFIG, help="SLO classes TOML")
    system.add_argument(
        "--ttft-ms", type=positive_float,
        help="override the default class's TTFT (an end-to-end class's: its first-token budget)",
    )
    system.add_argument("--tpot-ms", type=positive_float,
                        help="override the default class's TPOT (a TTFT+TPOT class)")
    system.add_argument("--e2e-ms", type=positive_float,
                        help="override the default class's end-to-end target (an e2e class)")
    system.add_argument(
        "--max-token-budget", type=int, default=8192, help="FairBatching's MAX_TOKEN_BUDGET"
    )
    system.add_argument("--drain-seconds", type=positive_float, default=120.0,
                        help="simulate this long after the last arrival; unfinished = violated")
    system.add_argument("--seed", type=int, default=0, help="GPU noise and synthetic arrivals")
    system.add_argument(
        "--step-model", type=Path,
        help="initial step-model TOML, of its form (default: offline fit of --step-form on the "
        "profile, as `calibrate` prints); the policies recalibrate online from there",
    )
    system.add_argument(
        "--step-form", choices=STEP_FORMS, default="knee",
        help="the offline fit's form when no --step-model is given (fb keeps the linear model "
        "either way; default: knee)",
    )
    system.add_argument(
        "--frozen-knee", action="store_true",
        help="keep the knee model's knee at the file's value (default: learned online with "
        "its coefficients)",
    )
    system.add_argument(
        "--calibrate", action="store_true",
        help="FairBatching-family policies first fit the step model's form on the simulated "
        "device with the scheduler's start-up calibration plan, as a server with "
        "`calibrate = true` does (default: start from the file)",
    )
    parser.add_argument("--out", type=Path, help="output directory (default: out/<command>-<time>)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_ext.sim",
        description="Discrete-event simulation of FairBatching and the baselines on a roofline GPU.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="one or more policies at one offered load")
    run.add_argument(
        "--policy", action="append", dest="policies", metavar="POLICY",
        help="policy name, NAME@BUDGET for budgeted ones; repeatable: each runs at --rate, "
        "one row of the table and one entry of results.json per policy (default: fb)",
    )
    run.add_argument("--rate", type=positive_float,
                     help="offered load, req/s (default: the trace's own rate)")
    _add_admission(run)
    _add_disagg(run)
    _common(run)
    sweep = commands.add_parser("sweep", help="policies x offered loads (bundled sample by default)")
    sweep.add_argument("--policy", action="append", dest="policies",
                       help=f"repeatable (default: {' '.join(DEFAULT_POLICIES)}; with --class-mix "
                       f"of several classes also {' '.join(PRIORITY_BASELINES)})")
    sweep.add_argument("--rates", type=_rate_list, default=None,
                       help=f"offered loads, req/s (default: {','.join(f'{r:g}' for r in QUICK_RATES)}; "
                       f"with --full {','.join(f'{r:g}' for r in DEFAULT_RATES)})")
    sweep.add_argument(
        "--full", action="store_true",
        help="the full sweep: every tunable family named bare (sarathi, sarathi-queue-cap, ...) "
        "tuned by its search over the full load grid (the default run: about 2,700 simulations, "
        "about an hour on 2 cores); without it such a family runs at the tuned settings file's setting",
    )
    sweep.add_argument(
        "--retune", action="store_true",
        help="tune every tunable family named bare on this scenario (over --rates, default the "
        "quick grid) instead of using the tuned settings file",
    )
    sweep.add_argument(
        "--tuned-settings", type=Path, metavar="PATH",
        help="the tuned settings to run bare families at (default: the shipped "
        "configs/tuned_baselines.toml; it is used only on the scenario it was tuned on, "
        "otherwise the families are tuned here); a file given here for another scenario is refused",
    )
    sweep.add_argument(
        "--save-tuned", type=Path, metavar="PATH",
        help="write the settings this sweep tuned (with --full or --retune) as a tuned "
        "settings file, with the scenario and the command",
    )
    sweep.add_argument(
        "--budgets", type=_budget_list, default=None,
        help="token budgets for the tuned families (sarathi, fb-fb, sarathi-queue-cap, "
        "sarathi-queue-timeout named without @...), searched exactly as given; default: "
        f"{','.join(map(str, DEFAULT_TOKEN_BUDGETS))}, then refined around the best "
        "(sglang_ext.sim.fitting.tuning)",
    )
    sweep.add_argument("--cdf-rate", type=positive_float,
                       help="load whose latency CDFs are plotted (default: the middle rate)")
    _add_executor(sweep, "simulations at once: worker processes, or a local Ray instance's "
                  "CPUs (default: all cores)")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_admission(sweep)
    _add_disagg(sweep)
    _common(sweep)
    show = commands.add_parser(
        "demo",
        help="the shipped FairBatching against the three strongest baselines, one SLO class "
        "and three (scripts/demo.sh; every policy: scripts/demo.sh --all, the sweep)",
    )
    _add_executor(show, "simulations at once: worker processes, or a local Ray instance's "
                  "CPUs (default: all cores)")
    show.add_argument("--no-progress", action="store_true", help="no progress bar")
    show.add_argument("--out", type=Path, help="output directory (default: out/demo-<time>)")
    cap = commands.add_parser(
        "capacity",
        help="bisect the offered load to each policy's capacity (overall, worst prompt "
        "bucket, worst SLO class)",
        description="Capacity, the paper's measure: the highest offered load at which at "
        "least --target of requests meet their SLO, overall, in the worst prompt-length "
        "bucket and in the worst SLO class (the lowest-attainment group of at least "
        "--min-group-requests requests). Attainment need not fall monotonically with load "
        "(noise), so capacity is the highest probed load meeting the target such that every "
        "lower probed load meets it too; the lowest probed load that fails closes the "
        "bracket. Per policy: doubling or halving from --start until bracketed, then "
        "geometric bisection until the bracket is within --tolerance "
        "(sglang_ext.sim.capacity). A tunable family named bare runs on its defaults.",
    )
    cap.add_argument("--policy", action="append", dest="policies", metavar="POLICY",
                     required=True, help="repeatable: each policy is bisected on its own")
    cap.add_argument("--target", action="append", dest="targets", type=_target,
                     metavar="SHARE",
                     help="share of requests meeting their SLO, in (0, 1]; repeatable "
                     f"(default: {' and '.join(f'{t:g}' for t in capacity.TARGETS)})")
    cap.add_argument("--start", type=positive_float,
                     help="first load probed, req/s (default: the trace's own rate)")
    cap.add_argument("--tolerance", type=positive_float, default=capacity.DEFAULT_TOLERANCE,
                     help="stop when the lowest failing load is within this fraction above "
                     "the capacity (default: %(default)g)")
    cap.add_argument("--min-rate", type=positive_float,
                     help="never probe below this load (default: --start / 64)")
    cap.add_argument("--max-rate", type=positive_float,
                     help="never probe above this load (default: --start x 64)")
    cap.add_argument("--min-group-requests", type=positive_int, default=MIN_GROUP_REQUESTS,
                     help="the fewest requests a prompt bucket or SLO class needs to be the "
                     "worst one (default: %(default)d)")
    _add_executor(cap, "policies bisected at once: worker processes, or a local Ray "
                  "instance's CPUs (default: all cores)")
    _add_admission(cap)
    _add_disagg(cap)
    _common(cap)
    cluster = commands.add_parser(
        "cluster",
        help="data-parallel ranks behind the control plane's balancer, one offered load",
        description="N simulated ranks, each running --policy, behind one dispatcher that "
        "routes with the control plane's balancer and PAB ledger (reports reach it "
        "--report-delay-ms late). A request no rank's budget covers (the pab balancers) "
        "is handled by --on-no-budget, the daemon's on_no_budget.",
    )
    cluster.add_argument("--ranks", type=positive_int, default=8, help="data-parallel ranks")
    cluster.add_argument("--balancer", choices=BALANCERS, default="pab",
                         help="the control plane's policy for choosing a rank")
    cluster.add_argument("--policy", default="fb",
                         help="every rank's batch policy, NAME@BUDGET for budgeted ones")
    cluster.add_argument("--rate", type=positive_float,
                         help="offered load of the whole cluster, req/s (default: the trace's "
                         "own rate x --ranks)")
    cluster.add_argument("--report-delay-ms", type=non_negative_float,
                         default=DEFAULT_REPORT_DELAY_S * 1e3,
                         help="a rank's report reaches the dispatcher this late")
    cluster.add_argument("--on-no-budget", choices=ON_NO_BUDGET, default="queue",
                         help="a request no rank's budget covers: rejected, queued (for at "
                         "most its TTFT target, capped by --queue-ttl) or spilled to the "
                         "balancer's choice with budgets ignored (default: %(default)s)")
    cluster.add_argument("--queue-ttl", type=positive_float, default=DEFAULT_QUEUE_TTL_S,
                         help="seconds a request may wait in the pab balancers' admission "
                         "queue (the daemon's queue_ttl_s)")
    cluster.add_argument("--max-queued", type=positive_int, default=DEFAULT_MAX_QUEUED,
                         help="admission queue bound; a fuller queue rejects (max_queued)")
    cluster.add_argument("--client-retries", type=non_negative_int, default=0,
                         help="resubmissions of a request refused no_budget, overloaded or "
                         "queue_timeout, after the daemon's retry_after_s as the SDK does (the "
                         f"gateway's SDK: {DEFAULT_MAX_RETRIES}; default: %(default)s, each "
                         "request submitted once)")
    _common(cluster)
    calibrate = commands.add_parser(
        "calibrate", help="offline-fit a step model (knee or linear) on a profile"
    )
    calibrate.add_argument("--profile", default=DEFAULT_PROFILE, help="bundled name or TOML path")
    calibrate.add_argument("--form", choices=STEP_FORMS, default="knee",
                           help="the model's form (a knee file carries the linear fit too)")
    calibrate.add_argument("--out", type=Path, help="write the step-model TOML here")
    check = commands.add_parser(
        "predictor-check",
        help="held-out and online error of each step-time predictor on a measured grid CSV",
    )
    check.add_argument("--grid", type=Path, required=True,
                       help="a measured grid (the CSV format of python -m benchmarks.gpu.step_profiler)")
    check.add_argument("--seed", type=int, default=0, help="the 2/3 split and the serving order")
    check.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                       help="online steps before the error counts")
    check.add_argument("--json", type=Path, help="also write the figures here")
    fit = commands.add_parser(
        "fit-grid",
        help="fit a simulator profile and a step-model file to a measured grid CSV",
        description="Turn a measured step-time grid (python -m benchmarks.gpu.step_profiler) into a hardware "
        "profile for the simulator (the base's roofline with its efficiencies and overheads "
        "fitted) and a step-model file for the scheduler (`step_model` in "
        "configs/fairbatching.toml, or the simulator's --step-model), both fitted to "
        "the grid's device times. The grid's JSON sidecar names the model it measured; "
        "--base supplies the GPU's peaks and the noise and memory fields.",
    )
    fit.add_argument("--grid", type=Path, required=True, help="a measured grid CSV")
    fit.add_argument("--base", required=True,
                     help="profile supplying the GPU (bundled name or TOML path)")
    fit.add_argument("--name", help="the fitted profile's name (default: the grid's file name)")
    fit.add_argument("--form", choices=STEP_FORMS, default="knee",
                     help="the step model's form (a knee file carries the linear fit too)")
    fit.add_argument("--out-profile", type=Path, required=True, help="profile TOML to write")
    fit.add_argument("--out-step-model", type=Path, required=True,
                     help="step-model TOML to write")
    refuse_repeats(parser, REPEAT_HINTS)
    return parser


#: what to do instead, in the error of a single-valued option given twice
REPEAT_HINTS = {
    "--rate": "one load per run; `sweep --rates 4,8,...` runs several",
    "--rates": "give the loads as one comma-separated list",
    "--budgets": "give the budgets as one comma-separated list",
    "--policy": "every rank runs the one policy; run `cluster` once per policy",
}


def _load_profile(name: str) -> HardwareProfile:
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        return load_profile(path)
    return load_profile(bundled_profile_path(name))


def _catalog(args: argparse.Namespace) -> SloCatalog:
    """The SLO file's catalog, its default class's targets overridden by ``--ttft-ms``,
    ``--tpot-ms`` (a TTFT+TPOT class) or ``--e2e-ms`` (an end-to-end class); an override
    never changes the class's kind."""
    catalog = SloCatalog.from_toml(args.slo_config)
    overrides = {key: value for key, value in (
        ("ttft_ms", args.ttft_ms), ("tpot_ms", args.tpot_ms), ("e2e_ms", args.e2e_ms),
    ) if value is not None}
    if not overrides:
        return catalog
    name = catalog.default_class
    end_to_end = catalog.default.is_end_to_end
    foreign = "tpot_ms" if end_to_end else "e2e_ms"
    if foreign in overrides:
        kind, fits = ("end-to-end", "--e2e-ms") if end_to_end else ("TTFT+TPOT", "--tpot-ms")
        raise CliError(
            f"--{foreign.replace('_', '-')}: the default class {name!r} of {args.slo_config} "
            f"is {kind}; override its targets with --ttft-ms and {fits}"
        )
    try:
        overridden = catalog.resolve({"class": name, **overrides})
    except SloError as exc:
        raise CliError(f"SLO override of the default class {name!r}: {exc}") from None
    return SloCatalog(name, dict(catalog.classes, **{name: overridden}))


def _workload(args: argparse.Namespace, catalog: SloCatalog) -> Workload:
    if args.trace is None:
        workload = bundled_sample()
        head = args.head_seconds or DEFAULT_SAMPLE_HEAD_S
    else:
        workload = load_workload(args.trace, args.format)
        head = args.head_seconds
    if args.skip_seconds:
        workload = workload.skip(args.skip_seconds)
    if head is not None:
        workload = workload.head(head)
    unknown = {
        r.slo_class for r in workload.requests if r.slo_class and r.slo_class not in catalog.classes
    }
    if unknown:
        raise CliError(f"trace names SLO class(es) {sorted(unknown)} not in {args.slo_config}")
    if args.class_mix is not None:
        missing = sorted({name for name, _ in args.class_mix.fractions} - set(catalog.classes))
        if missing:
            raise CliError(
                f"--class-mix names SLO class(es) {missing} not in {args.slo_config} "
                f"(defined: {', '.join(sorted(catalog.classes))})"
            )
        workload = workload.with_class_mix(args.class_mix, args.seed)
    return workload


def _scenario(args: argparse.Namespace, disagg: DisaggConfig = DisaggConfig()) -> Scenario:
    if args.max_token_budget < 1:
        raise CliError("--max-token-budget must be >= 1")
    catalog = _catalog(args)
    return Scenario(
        disagg=disagg,
        workload=_workload(args, catalog),
        profile=_load_profile(args.profile),
        catalog=catalog,
        arrivals=args.arrivals,
        seed=args.seed,
        drain_s=args.drain_seconds,
        max_token_budget=args.max_token_budget,
        step_model=StepModelFile.load(args.step_model) if args.step_model else None,
        learn_knee=not args.frozen_knee,
        step_form=args.step_form,
        calibrate=args.calibrate,
    )


def _out_dir(args: argparse.Namespace) -> Path:
    return args.out or Path("out") / f"{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"


def _with_admission(texts: Sequence[str], admission: AdmissionSettings | None) -> list[str]:
    """``--admission`` appended to every FairBatching-family policy named without its own."""
    if admission is None:
        return list(texts)
    labels = []
    for text in texts:
        spec = parse_policy(text)
        takes = spec.admission is None and POLICIES.get(spec.base).takes_admission
        labels.append(f"{text}+{admission.label}" if takes else text)
    if labels == list(texts):
        raise CliError(
            "--admission applies to FairBatching-family policies named without +MODE; "
            f"none among {', '.join(texts)}"
        )
    return labels


def _cmd_run(args: argparse.Namespace) -> int:
    labels = _with_admission(args.policies or ["fb"], args.admission)
    # each policy once, in the order given (by its label: `fb` twice, or `fb+defer` and
    # `fb --admission defer`, is one run)
    specs = list({spec.label: spec for spec in map(parse_policy, labels)}.values())
    disagg = _disagg_config(args, specs)
    scenario = _scenario(args, disagg)
    for spec in specs:  # a policy that cannot be built fails before any simulation
        build_policy(scenario, spec)
    rate = args.rate or scenario.workload.mean_rate
    results = [simulate(scenario, spec, rate) for spec in specs]
    plan = SweepPlan(tuple(spec.label for spec in specs), tuple(specs))
    # the same results.json document as a sweep of these policies at one rate (scenario and
    # rates included)
    document, _ = assemble(scenario, plan, (rate,), rate, results)
    print(summary_table(document, plan.requested))
    disaggregated = [(spec, result) for spec, result in zip(specs, results, strict=True)
                     if POLICIES.get(spec.base).disaggregated]
    if disaggregated:
        document["disaggregated"] = _disagg_entry(disagg)
        print()
    for spec, result in disaggregated:
        load = result.load
        print(
            f"{f'{spec.label}: ' if len(specs) > 1 else ''}"
            f"{disagg.gpus} GPUs ({disagg.prefill_ranks} prefill + {disagg.decode_ranks} "
            f"decode, KV link {disagg.link_gbps:g} Gb/s): effective RPS "
            f"{load['effective_rps']:.2f} total, {load['effective_rps_per_gpu']:.2f} per GPU"
        )
    path = write_results(document, _out_dir(args))
    print(f"\nwrote {path}")
    return 0


def _disagg_entry(config: DisaggConfig) -> dict:
    return {"gpus": config.gpus, "split": config.split, "prefill_ranks": config.prefill_ranks,
            "decode_ranks": config.decode_ranks, "link_gbps": config.link_gbps}


def _cmd_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sglang_ext.sim.plots import plot_effective_rps, plot_fairness, plot_latency_cdfs

    executor = _executor_spec(args)
    several_classes = args.class_mix is not None and len(args.class_mix.fractions) > 1
    names = _with_admission(args.policies or default_policies(several_classes), args.admission)
    plan = plan_sweep(names, args.budgets)
    disagg = _disagg_config(args, plan.runs + tuple(parse_policy(n) for n in plan.tuned))
    scenario = _scenario(args, disagg)
    mode = sweep_modes.choose_mode(plan, scenario, full=args.full, retune=args.retune,
                            settings_path=args.tuned_settings, save_tuned=args.save_tuned)
    if mode.presets:
        plan = plan_sweep(names, args.budgets, mode.presets)
    rates = args.rates or (DEFAULT_RATES if args.full else QUICK_RATES)
    cdf_rate = args.cdf_rate or rates[len(rates) // 2]
    if cdf_rate not in rates:
        rates = tuple(sorted({*rates, cdf_rate}))
    print(
        f"{len(scenario.workload.requests)} requests from {scenario.workload.source} "
        f"(natural rate {scenario.workload.mean_rate:.2f} req/s) on {scenario.profile.name}; "
        f"{len(plan.runs)} policies as given and {len(plan.tuned)} tuned "
        f"({', '.join(plan.tuned) or 'none'}) x {len(rates)} loads",
        file=sys.stderr,
    )
    note = sweep_modes.start_note(mode, plan)
    if note:
        print(note, file=sys.stderr)
    with tqdm(total=0, unit="sim", disable=args.no_progress, file=sys.stderr) as bar:
        document, samples = run_sweep(
            scenario, plan, rates, cdf_rate=cdf_rate, jobs=args.jobs, executor=executor,
            progress=bar.update,
            planned=lambda n: (setattr(bar, "total", bar.total + n), bar.refresh()),
        )
    if any(POLICIES.get(spec.base).disaggregated for spec in plan.runs) or any(
        POLICIES.get(parse_policy(name).base).disaggregated for name in plan.tuned
    ):
        document["disaggregated"] = _disagg_entry(disagg)
    out = _out_dir(args)
    path = write_results(document, out)
    plot_effective_rps(document, plan.requested, out / "effective_rps.png")
    plot_latency_cdfs(document, samples, plan.requested, out / "latency_cdf.png")
    plot_fairness(document, plan.requested, out / "fairness.png")
    print(summary_table(document))
    if args.save_tuned:
        args.save_tuned.parent.mkdir(parents=True, exist_ok=True)
        args.save_tuned.write_text(settings_toml(
            document, scenario_fingerprint(scenario),
            shlex.join(["python", "-m", "sglang_ext.sim", *args.argv]), commit=git_commit(),
        ))
        print(f"\nwrote the tuned settings to {args.save_tuned}")
    print("\n" + sweep_modes.closing_summary(
        document, plan, mode, full_rates=DEFAULT_RATES, rates_given=args.rates is not None,
        results=path,
        plots=(out / "effective_rps.png", out / "latency_cdf.png", out / "fairness.png"),
    ))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sglang_ext.sim.plots import demo_figure, save_figure

    executor = _executor_spec(args)
    shipped = demo.shipped_policy()
    sweep_parser = build_parser()
    cases = []
    for case in demo.CASES:
        scenario = _scenario(sweep_parser.parse_args(["sweep", *case.sweep_argv]))
        source = display_path(case.tuned_file)
        regenerate = shlex.join(["python", "-m", "sglang_ext.sim", "sweep", "--full",
                                 *case.sweep_argv, "--save-tuned", source])
        if not case.tuned_file.is_file():
            raise CliError(f"the demo's tuned baselines for {case.title}, {source}, are "
                           f"missing; write them with `{regenerate}`")
        settings = tuned_load(case.tuned_file)
        differences = settings.differences(scenario_fingerprint(scenario))
        if differences:
            raise CliError(f"{source} was tuned on another scenario than the demo's "
                           f"{case.title} ({'; '.join(differences)}); regenerate it with "
                           f"`{regenerate}`")
        baselines = demo.strongest_baselines(settings)
        plan = plan_sweep([shipped, *baselines], None, sweep_modes.presets(settings, baselines))
        cases.append((case, scenario, baselines, plan))
    out = _out_dir(args)
    total = sum(len(plan.runs) for *_, plan in cases) * len(QUICK_RATES)
    documents = []
    with tqdm(total=total, unit="sim", disable=args.no_progress, file=sys.stderr) as bar:
        for case, scenario, baselines, plan in cases:
            document, _ = run_sweep(scenario, plan, QUICK_RATES, cdf_rate=case.table_rate,
                                    jobs=args.jobs, executor=executor, progress=bar.update)
            write_results(document, out / case.slug)
            documents.append(document)
    for (case, _, baselines, plan), document in zip(cases, documents):
        names = [shipped, *baselines]
        print(demo.case_heading(case, document, baselines))
        print(demo.case_tables(document, names, case, shipped) + "\n")
    labels = {name: f"{name} (shipped)" if name == shipped else name  # settings differ per case
              for *_, plan in cases for name in plan.requested}
    figure = save_figure(demo_figure(
        [(case.title, document, [shipped, *baselines], case.worst_group)
         for (case, _, baselines, _), document in zip(cases, documents)], labels),
        out / "demo.png")
    for case, *_ in cases:
        print(f"results, {case.title}: {out / case.slug / 'results.json'}")
    print(f"figure: {figure}")
    print("every policy, each baseline at its tuned setting: scripts/demo.sh --all")
    return 0


_capacity_scenario: Scenario | None = None


def _capacity_init(scenario: Scenario) -> None:
    global _capacity_scenario
    _capacity_scenario = scenario  # a worker's (forked, or shipped by Ray's cloudpickle)


def _capacity_job(job: tuple) -> tuple[str, capacity.CapacitySearch, float]:
    """One policy's bisection (a worker process's job): its label, search and wall time."""
    spec, options, min_group = job
    scenario = _capacity_scenario
    assert scenario is not None
    began = time.perf_counter()

    def evaluate(rate: float) -> dict:
        load = simulate(scenario, spec, rate).load
        if min_group != MIN_GROUP_REQUESTS:
            load["worst_prompt_bucket"] = worst_group(load["by_prompt_tokens"], min_group)
            load["worst_slo_class"] = worst_group(load["by_slo_class"], min_group)
        return load

    search = capacity.bisect_capacity(evaluate, **options)
    return spec.label, search, time.perf_counter() - began


def _cmd_capacity(args: argparse.Namespace) -> int:
    executor = _executor_spec(args)
    labels = _with_admission(args.policies, args.admission)
    specs = list({spec.label: spec for spec in map(parse_policy, labels)}.values())
    scenario = _scenario(args, _disagg_config(args, specs))
    for spec in specs:  # a policy that cannot be built fails before any simulation
        build_policy(scenario, spec)
    targets = tuple(sorted(set(args.targets or capacity.TARGETS)))
    start = args.start or scenario.workload.mean_rate
    options = {"targets": targets, "start": start, "tolerance": args.tolerance,
               "min_rate": args.min_rate, "max_rate": args.max_rate}
    if args.min_rate and args.max_rate and args.min_rate >= args.max_rate:
        raise CliError("--min-rate must be below --max-rate")
    jobs = [(spec, options, args.min_group_requests) for spec in specs]
    began = time.perf_counter()
    pool = open_pool(executor, args.jobs, _capacity_init, (scenario,), tasks=len(jobs))
    workers = pool.workers
    with pool.executor:
        done = list(pool.executor.map(_capacity_job, jobs))
    wall = time.perf_counter() - began
    runs = [RunResult(label, load, None) for label, search, _ in done
            for load in search.loads.values()]
    plan = SweepPlan(tuple(spec.label for spec in specs), tuple(specs))
    rates = sorted({run.load["rate"] for run in runs})
    document, _ = assemble(scenario, plan, rates, start, runs)
    for label, search, seconds in done:
        document["policies"][label]["capacity"] = search.capacity
        document["policies"][label]["capacity_search"] = {
            "simulations": search.simulations, "wall_s": seconds,
        }
    document["capacity"] = {
        "targets": list(targets), "measures": list(capacity.MEASURES), "start": start,
        "tolerance": args.tolerance, "min_rate": args.min_rate or capacity.round_rate(start / 64),
        "max_rate": args.max_rate or capacity.round_rate(start * 64),
        "min_group_requests": args.min_group_requests,
        "simulations": len(runs), "wall_s": wall, "jobs": workers,
    }
    print(capacity.bisection_table(document, plan.requested))
    print(f"\n{len(runs)} simulations in {wall:.1f} s ({workers} at once)")
    path = write_results(document, _out_dir(args))
    print(f"\nwrote {path}")
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    spec = parse_policy(args.policy)
    if POLICIES.get(spec.base).disaggregated:
        raise CliError(f"policy {spec.base!r} runs disaggregated (prefill and decode ranks "
                       f"apart), not on data-parallel ranks: use `run --policy {spec.base} "
                       "--split P:D`")
    config = ClusterConfig(
        ranks=args.ranks,
        balancer=args.balancer,
        report_delay_s=args.report_delay_ms / 1e3,
        queue_ttl_s=args.queue_ttl,
        max_queued=args.max_queued,
        on_no_budget=args.on_no_budget,
        client_retries=args.client_retries,
    )
    scenario = _scenario(args)
    rate = args.rate or scenario.workload.mean_rate * config.ranks
    result = simulate_cluster(scenario, spec, rate, config)
    plan = SweepPlan((result.label,), (spec,))
    run = RunResult(result.label, result.load, None)
    document, _ = assemble(scenario, plan, (rate,), rate, [run])
    document["cluster"] = {
        "ranks": config.ranks,
        "balancer": config.balancer,
        "rank_policy": spec.label,
        "report_delay_s": config.report_delay_s,
        "on_no_budget": config.on_no_budget,
        "queue_ttl_s": config.queue_ttl_s,
        "max_queued": config.max_queued,
        "client_retries": config.client_retries,
    }
    print(summary_table(document, plan.requested))
    load = result.load
    print(
        f"\ndispatched per rank {load['dispatched_per_rank']} (max/mean "
        f"{load['dispatch_imbalance']:.2f}); rejected {load['rejected']} "
        f"(dispatcher: {load['queue_timeout']} queue timeout, {load['overloaded']} overloaded, "
        f"{load['no_budget']} no budget; ranks: {load['rejected_by_ranks']}); "
        f"{load['queued']} queued, {load['spilled']} spilled"
    )
    path = write_results(document, _out_dir(args))
    print(f"\nwrote {path}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    profile = _load_profile(args.profile)
    fit = offline_step_model(profile, args.form)
    shapes, seconds = profile_steps(profile)
    errors = [abs(fit.model.predict_step(s) - t) / t for s, t in zip(shapes, seconds, strict=True)]
    text = fit.to_toml(
        f"Offline fit on simulated profile {profile.name} "
        f"(python -m sglang_ext.sim calibrate --profile {args.profile} --form {args.form})",
        samples=len(shapes),
        mean_abs_rel_error=sum(errors) / len(errors),
        max_abs_rel_error=max(errors),
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    print(text, end="")
    return 0


def _cmd_predictor_check(args: argparse.Namespace) -> int:
    rows = read_grid(args.grid)
    check = check_predictors(rows, seed=args.seed, warmup=args.warmup)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(as_json(check, str(args.grid)), indent=1) + "\n")
    print(render(check, str(args.grid)))
    return 0


def _cmd_fit_grid(args: argparse.Namespace) -> int:
    rows = read_grid(args.grid)
    meta = read_grid_meta(args.grid)
    name = args.name or args.grid.stem
    command = shlex.join(["python", "-m", "sglang_ext.sim", *args.argv])
    fit = fit_grid(rows, _load_profile(args.base), name, meta, args.form)
    errors = sorted(fit.step_model_errors)
    mean_error = sum(errors) / len(errors)
    for path in (args.out_profile, args.out_step_model):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.out_profile.write_text(fitted_profile_toml(fit.profile, grid=str(args.grid), command=command))
    fit.step_model.save(
        args.out_step_model,
        f"Fitted to the measured grid {args.grid} ({len(rows)} rows)\n({command})",
        samples=len(rows), mean_abs_rel_error=mean_error, max_abs_rel_error=errors[-1],
    )
    overall = fit.profile.residual("all")
    print(f"profile {name} -> {args.out_profile}: median error {overall.median_signed_pct:+.1f}%, "
          f"median |error| {overall.median_abs_pct:.1f}%, p90 |error| {overall.p90_abs_pct:.1f}%")
    print(f"{args.form} step model -> {args.out_step_model}: mean |error| {mean_error:.1%}, "
          f"worst {errors[-1]:.1%} over {len(rows)} rows (in-sample; predictor-check holds rows out)")
    return 0


USER_ERRORS = (
    CliError, WorkloadError, ProfileError, SloError, PolicySpecError, StepModelError,
    TunedSettingsError, ClusterConfigError, DisaggConfigError, GridError, ExecutorError,
    json.JSONDecodeError,
)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    handler = {
        "run": _cmd_run, "sweep": _cmd_sweep, "demo": _cmd_demo, "capacity": _cmd_capacity,
        "cluster": _cmd_cluster,
        "calibrate": _cmd_calibrate, "predictor-check": _cmd_predictor_check,
        "fit-grid": _cmd_fit_grid,
    }[args.command]
    try:
        return handler(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_USAGE

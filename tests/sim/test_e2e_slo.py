"""End-to-end SLOs through the simulator: the engine's learnt envelope, every runner's
records, the results.json v2 fields, the CLI's overrides and the multi-SLO catalog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_helpers import llama, make_policy, synthetic_workload

from sglang_ext.policy.slo import Slo, SloCatalog
from sglang_ext.sim.commands import main
from sglang_ext.sim.cluster import ClusterConfig, ClusterSimulation
from sglang_ext.sim.disagg import Arrival, DisaggConfig, run_disaggregated
from sglang_ext.sim.engine import SimEngine
from sglang_ext.sim.metrics import summarize
from sglang_ext.sim.plots import plot_latency_cdfs, slo_text
from sglang_ext.sim.runner import Scenario, build_policy, parse_policy, replay, simulate
from sglang_ext.sim.sweep import SCHEMA_VERSION, SweepPlan, assemble, summary_table
from sglang_ext.sim.workloads import ClassMix, TraceRequest, Workload

REPO = Path(__file__).resolve().parents[2]
MULTI = REPO / "configs" / "slo-multi.toml"
CODE = Slo.end_to_end_ms(14_000)  # first token due at 3.5 s, the last expected at 14 s
CHAT = Slo.from_ms(2000, 50)
CATALOG = SloCatalog("chat", {"chat": CHAT, "code": CODE})


def _paced(slo: Slo, tokens: int) -> float:
    return (slo.e2e_s - slo.ttft_s) / (tokens - 1)


# ------------------------------------------------------------------ the engine
def test_an_e2e_envelope_follows_the_learnt_mean_of_its_class():
    engine = SimEngine(llama(), make_policy("sglang-default", llama()))
    tpots = []
    for index, output in enumerate((100, 300, 50)):
        engine.submit(index, 10.0 * index, 500, output, CODE, "code")  # each alone
        (request,) = engine.active_requests
        tpots.append(request.slo.tpot_s)
        assert request.task == "code" and engine.records[index].slo is request.slo
        engine.run_until_idle(10.0 * index + 9.0)
        assert engine.records[index].finished
    # the prior (256 tokens) until two requests finished, then their mean (200 tokens)
    assert tpots[0] == tpots[1] == pytest.approx(_paced(CODE, 256))
    assert tpots[2] == pytest.approx(_paced(CODE, 200))
    engine.submit(3, 40.0, 500, 10, CODE, "code")
    assert engine.records[3].slo.tpot_s == pytest.approx(_paced(CODE, 150))
    assert engine.records[3].slo.e2e_s == CODE.e2e_s and engine.records[3].slo.ttft_s == 3.5


def test_classes_learn_apart_and_a_ttft_tpot_slo_is_kept_as_given():
    engine = SimEngine(llama(), make_policy("sglang-default", llama()))
    for index, output in enumerate((20, 40)):
        engine.submit(index, 10.0 * index, 500, output, CODE, "code")
        engine.run_until_idle(10.0 * index + 9.0)
    engine.submit("other", 30.0, 500, 5, CODE, "batch")
    engine.submit("chat", 30.0, 500, 5, CHAT, "chat")
    assert engine.records["other"].slo == CODE  # its class has finished nothing yet
    assert engine.records["chat"].slo is CHAT
    assert engine.records["chat"].slo_class == "chat"


def test_an_e2e_request_finishing_late_is_violated_though_its_first_token_was_early():
    engine = SimEngine(llama(), make_policy("sglang-default", llama()))
    tight = Slo.end_to_end_ms(1500)  # 400 tokens alone take ~2.6 s, 100 tokens ~0.7 s
    engine.submit("chat", 0.0, 500, 50, CHAT, "chat")
    engine.submit("long", 0.0, 500, 400, tight, "code")
    engine.submit("short", 0.0, 500, 100, tight, "code")
    engine.run_until_idle(60.0)
    records = engine.records
    long = records["long"]
    assert long.finished and long.ttft_s < tight.ttft_s and not long.slo_met
    assert long.e2e_s > 1.5
    assert records["short"].slo_met and records["chat"].slo_met
    summary = summarize(records.values(), 1.0, engine.now)
    assert summary["by_slo_class"]["code"]["attainment"] == 0.5
    assert summary["by_slo_class"]["chat"]["attainment"] == 1.0
    assert summary["ttft_attainment"] == 1.0 and summary["attainment"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------ the runners
def _scenario(mix: str | None = "chat:0.5,code:0.5", n: int = 40) -> Scenario:
    workload = synthetic_workload(n)
    if mix:
        workload = workload.with_class_mix(ClassMix.parse(mix), 0)
    return Scenario(workload, llama(), SloCatalog.from_toml(MULTI), drain_s=30.0)


def _assert_classes_match_kinds(records) -> None:
    assert {r.slo_class for r in records} == {"chat", "code"}
    for record in records:
        assert record.slo.is_end_to_end == (record.slo_class == "code")


def test_replay_gives_every_record_its_class():
    scenario = _scenario()
    engine, _ = replay(scenario, build_policy(scenario, parse_policy("fb")), 8.0)
    _assert_classes_match_kinds(engine.records.values())
    unclassed = _scenario(None, n=10)
    engine, _ = replay(unclassed, build_policy(unclassed, parse_policy("fb")), 8.0)
    assert {r.slo_class for r in engine.records.values()} == {"chat"}  # the default class


def test_simulate_reports_each_class():
    load = simulate(_scenario(), parse_policy("fb-anchor-margin"), 8.0).load
    classes = load["by_slo_class"]
    assert {name: c["kind"] for name, c in classes.items()} == {"chat": "ttft+tpot", "code": "e2e"}
    assert sum(c["requests"] for c in classes.values()) == load["requests"]
    assert load["e2e_ms"]["p50"] is not None


def test_a_disaggregated_run_keeps_classes_and_paces_e2e_decodes_by_the_learnt_mean():
    profile = llama()
    arrivals = [Arrival(i, 10.0 * i, 500, output, CODE, "code")
                for i, output in enumerate((1, 1, 100, 300, 20))]
    arrivals.append(Arrival("chat", 50.0, 500, 20, CHAT))
    run = run_disaggregated(arrivals, profile, lambda: make_policy("kairos-fcfs", profile),
                            DisaggConfig())
    records = run.records
    assert all(r.finished for r in records.values())
    assert records[0].slo_class == "code" and records["chat"].slo_class is None
    # two one-token requests finished at their prefill: 1 token expected, then 100 and 300
    assert records[2].slo.tpot_s == pytest.approx(_paced(CODE, 2))
    assert records[4].slo.tpot_s == pytest.approx(_paced(CODE, round((1 + 1 + 100 + 300) / 4)))
    assert records["chat"].slo is CHAT
    load = simulate(_scenario(n=20), parse_policy("kairos-fcfs"), 8.0).load
    assert set(load["by_slo_class"]) == {"chat", "code"}


def test_cluster_records_and_dispatcher_rejections_carry_classes():
    classes = ("chat", "code", None)
    # prompts past both classes' budgets once a few run: the queue holds back neither class
    burst = Workload(tuple(TraceRequest(0.001 * i, 12000, 4, classes[i % 3]) for i in range(30)),
                     "burst")
    scenario = Scenario(burst, llama(), CATALOG, drain_s=30.0)
    simulation = ClusterSimulation(scenario, parse_policy("fb"),
                                   ClusterConfig(1, "pab", queue_ttl_s=0.05, max_queued=2))
    simulation.run(burst.mean_rate)
    assert simulation.rejected_by_dispatcher
    _assert_classes_match_kinds(simulation.records.values())
    _assert_classes_match_kinds(simulation.rejected_by_dispatcher.values())


# ------------------------------------------------------------------ results.json and the CLI
FAST = ["--head-seconds", "20", "--rate", "8", "--drain-seconds", "30"]


def _run(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "out"
    assert main(["run", "--policy", "fb-anchor-margin", *FAST, *argv, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def test_a_mixed_run_prints_and_records_per_class_attainment(tmp_path, capsys):
    document = _run(tmp_path, "--slo-config", str(MULTI), "--class-mix", "chat:0.5,code:0.5")
    header = capsys.readouterr().out.splitlines()[0]
    assert header.split()[-2:] == ["chat", "code"]
    assert document["schema_version"] == SCHEMA_VERSION == 2
    assert document["scenario"]["slo"] == {
        "default_class": "chat", "ttft_ms": 2000.0, "tpot_ms": 50.0,
        "classes": {"chat": {"ttft_ms": 2000.0, "tpot_ms": 50.0},
                    "code": {"e2e_ms": 14000.0, "ttft_ms": 3500.0}},
    }
    load = document["policies"]["fb-anchor-margin"]["loads"][0]
    assert set(load["by_slo_class"]) == {"chat", "code"}
    assert "chat, code: the SLO attainment of each class's requests at 8 req/s (chat: ttft+tpot, " \
        "code: e2e)." in summary_table(document)


def test_a_single_class_table_has_no_class_columns(tmp_path, capsys):
    document = _run(tmp_path)
    assert capsys.readouterr().out.splitlines()[0].split()[-1] == "p99"
    assert "each class's requests" not in summary_table(document)
    assert slo_text(document) == "TTFT 2000 ms, TPOT 50 ms"


E2E_DEFAULT = "default_class = 'code'\n[classes.code]\ne2e_ms = 14000\n"


def test_an_e2e_default_class_is_recorded_and_overridden_as_e2e(tmp_path):
    slo_file = tmp_path / "slo.toml"
    slo_file.write_text(E2E_DEFAULT)
    document = _run(tmp_path, "--slo-config", str(slo_file), "--e2e-ms", "9000",
                    "--ttft-ms", "1000")
    slo = document["scenario"]["slo"]
    assert slo == {"default_class": "code", "e2e_ms": 9000.0, "ttft_ms": 1000.0,
                   "classes": {"code": {"e2e_ms": 9000.0, "ttft_ms": 1000.0}}}
    assert document["policies"]["fb-anchor-margin"]["loads"][0]["ttft_attainment"] is None
    assert slo_text(document) == "e2e 9000 ms"


OVERRIDE_ERRORS = [
    ("multi", ["--e2e-ms", "9000"], "--e2e-ms: the default class 'chat' of "),
    ("multi", ["--e2e-ms", "9000"],
     "is TTFT+TPOT; override its targets with --ttft-ms and --tpot-ms"),
    ("e2e", ["--tpot-ms", "40"], "is end-to-end; override its targets with --ttft-ms and --e2e-ms"),
    ("e2e", ["--ttft-ms", "20000"],
     "SLO override of the default class 'code': ttft_ms 20000 must be below e2e_ms 14000"),
    ("e2e", ["--e2e-ms", "2000", "--ttft-ms", "3000"], "ttft_ms 3000 must be below e2e_ms 2000"),
]


@pytest.mark.parametrize("config, argv, fragment", OVERRIDE_ERRORS)
def test_cli_refuses_overrides_that_do_not_fit_the_default_class(tmp_path, capsys, config, argv,
                                                                 fragment):
    slo_file = tmp_path / "slo.toml"
    slo_file.write_text(E2E_DEFAULT)
    path = MULTI if config == "multi" else slo_file
    out = tmp_path / "out"
    assert main(["run", "--policy", "fb", *FAST, "--slo-config", str(path), *argv,
                 "--out", str(out)]) == 2
    assert fragment in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_cli_e2e_ms_must_be_a_positive_number(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--e2e-ms", value])
    assert exit_info.value.code == 2
    assert "--e2e-ms" in capsys.readouterr().err


@pytest.mark.slow
def test_the_latency_cdfs_add_an_e2e_panel_for_an_e2e_class(tmp_path):
    scenario = _scenario(n=20)
    result = simulate(scenario, parse_policy("fb"), 8.0, keep_samples=True)
    assert len(result.samples.e2e_ms) == result.load["requests"] - result.load["unfinished"]
    plan = SweepPlan(("fb",), (parse_policy("fb"),))
    document, samples = assemble(scenario, plan, (8.0,), 8.0, [result])
    assert slo_text(document) == "chat: TTFT 2000 ms, TPOT 50 ms; code: e2e 14000 ms"
    path = plot_latency_cdfs(document, samples, ["fb"], tmp_path / "cdf.png")
    assert path.stat().st_size > 1000

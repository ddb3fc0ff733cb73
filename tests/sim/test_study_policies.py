"""The batching study's policies (``sglang_ext.sim.competitors.study_policies``), its service curve
(``sglang_ext.sim.service_curve``), their settings, tuning axes and CLI runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from sim_helpers import SLO, llama, drive_search as drive

from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.step_model import StepCoefficients
from sglang_ext.policy.step_shape import StepShape
from sglang_ext.policy.view import BatchDecision, RequestView
from sglang_ext.sim.fitting.calibration import offline_step_model
from sglang_ext.sim.commands import main
from sglang_ext.sim.engine import IDLE_TICK_S, SimEngine
from sglang_ext.sim.gpu import RooflineGpu
from sglang_ext.sim.profile import (
    ProfileError, ServiceSpec, bundled_profile_path, load_profile,
)
from sglang_ext.sim.fitting.profile_fit import profile_toml
from sglang_ext.sim.runner import PolicySpecError, parse_policy
from sglang_ext.sim.service_curve import ServiceCurveGpu, make_gpu
from sglang_ext.sim.competitors.study_policies import (
    DynamicBatch, FcfsToCompletion, FixedBatch, JobClock, PrefillFirst,
)
from sglang_ext.sim.fitting.tuning import INTEGER_SETTINGS, REFINE_STEP, tune

STUDY = ("fixed-batch", "dynamic-batch", "fcfs-complete", "prefill-first")
TUNABLE = ("fixed-batch", "dynamic-batch", "prefill-first")
NOW = 10.0
# a known step model: 5 ms + 0.1 ms per new token, context free
MODEL = StepCoefficients(0.005, 1e-4, 0.0)


def study_profile():
    return load_profile(bundled_profile_path("des-study"))


def ctx(token_budget: int | None = None, **settings: float) -> PolicyContext:
    return PolicyContext(global_slo=SLO, initial_step_model=MODEL, token_budget=token_budget,
                         settings=tuple(sorted(settings.items())))


def waiting(req_id, seq: int, prompt: int, arrival: float | None = None) -> RequestView:
    arrival = seq * 0.001 if arrival is None else arrival
    return RequestView(req_id, arrival, SLO, 0, prompt, 0, prompt, seq)


def decoding(req_id, seq: int, index: int = 3, context: int = 200) -> RequestView:
    return RequestView(req_id, seq * 0.001, SLO, index, 0, context, context - index, seq)


def partial(req_id, seq: int, done: int, pending: int) -> RequestView:
    return RequestView(req_id, seq * 0.001, SLO, 0, pending, done, done + pending, seq)


# ------------------------------------------------------------------ registry, settings
def test_registered_with_their_flags() -> None:
    classes = (FixedBatch, DynamicBatch, FcfsToCompletion, PrefillFirst)
    for name, cls in zip(STUDY, classes, strict=True):
        assert POLICIES.get(name) is cls and cls.name == name
        assert cls(ctx()).form_batch([], NOW).is_empty
    assert FixedBatch.setting_names == ("timeout_ms",)
    assert DynamicBatch.setting_names == ("low", "high", "latency_ms")
    assert PrefillFirst.setting_names == ("chunk",)
    assert not FcfsToCompletion.takes_token_budget and not FcfsToCompletion.setting_names
    assert all(POLICIES.get(name).takes_token_budget for name in TUNABLE)


def test_defaults() -> None:
    fixed = FixedBatch(ctx())
    assert fixed.token_budget == 128 and fixed.timeout_s == pytest.approx(SLO.tpot_s / 2)
    dynamic = DynamicBatch(ctx())
    assert dynamic.token_budget == 256 and (dynamic.low, dynamic.high) == (4.0, 16.0)
    assert dynamic.latency_s == pytest.approx(SLO.tpot_s)
    assert PrefillFirst(ctx()).token_budget == 128 and PrefillFirst(ctx()).chunk == 128
    assert PrefillFirst(ctx(512)).chunk == 512  # chunk defaults to the budget


def test_settings_parse_and_reach_the_policy() -> None:
    spec = parse_policy("dynamic-batch@512,low=2,high=8,latency_ms=30")
    assert spec.token_budget == 512
    assert spec.settings == (("high", 8.0), ("latency_ms", 30.0), ("low", 2.0))
    assert spec.label == "dynamic-batch@512,high=8,latency_ms=30,low=2"
    assert parse_policy(spec.label) == spec
    policy = DynamicBatch(ctx(512, **dict(spec.settings)))
    assert (policy.low, policy.high, policy.latency_s) == (2.0, 8.0, 0.03)
    assert FixedBatch(ctx(64, timeout_ms=12.5)).timeout_s == pytest.approx(0.0125)
    assert PrefillFirst(ctx(128, chunk=16.9)).chunk == 16  # rounded down
    assert PrefillFirst(ctx(128, chunk=0.4)).chunk == 1  # at least one token
    for name in TUNABLE:
        assert parse_policy(name).is_tunable
    assert not parse_policy("fcfs-complete").is_tunable
    assert not parse_policy("prefill-first@128").is_tunable


@pytest.mark.parametrize("text, message", [
    ("fixed-batch@64,cap=5", "has no setting 'cap' (settings: timeout_ms)"),
    ("dynamic-batch@64,depth=3", "(settings: low, high, latency_ms)"),
    ("prefill-first@128,chunk=0", "must be a finite number > 0"),
    ("fixed-batch@64,timeout_ms=-5", "must be a finite number > 0"),
    ("dynamic-batch@64,low=nan", "must be a finite number > 0"),
    ("prefill-first@128,chunk=x", "must be a number"),
    ("fcfs-complete@128", "takes no token budget"),
    ("fcfs-complete@128,chunk=3", "takes no token budget"),
    ("prefill-first@0", "must be >= 1"),
])
def test_bad_settings_are_spec_errors(text: str, message: str) -> None:
    with pytest.raises(PolicySpecError) as exc:
        parse_policy(text)
    assert message in str(exc.value)


def test_bad_setting_on_the_cli_is_one_error_line(tmp_path, capsys) -> None:
    code = main(["run", "--policy", "prefill-first@128,size=3", "--head-seconds", "5",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "error: policy 'prefill-first' has no setting 'size' (settings: chunk)" in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ job clock
def test_job_clock_prefill_waits_from_arrival_decode_from_its_token() -> None:
    clock = JobClock()
    jobs = clock.jobs([waiting("w", 1, 300, arrival=4.0), decoding("d", 0, index=2)], NOW)
    by_id = {job.req_id: job for job in jobs}
    assert by_id["w"].ready_s == 4.0 and by_id["w"].tokens == 300 and by_id["w"].is_prefill
    assert by_id["d"].ready_s == NOW and by_id["d"].tokens == 1 and not by_id["d"].is_prefill
    assert [job.req_id for job in jobs] == ["w", "d"]  # oldest ready first
    later = clock.jobs([waiting("w", 1, 300, arrival=4.0), decoding("d", 0, index=2)], NOW + 1)
    assert {job.req_id: job.ready_s for job in later} == {"w": 4.0, "d": NOW}  # unchanged
    after_token = clock.jobs([decoding("d", 0, index=3)], NOW + 2)
    assert after_token[0].ready_s == NOW + 2  # its next token became ready at this step's start
    assert clock.jobs([waiting("w", 1, 300, arrival=4.0)], NOW + 3)[0].ready_s == 4.0


def test_job_clock_forgets_requests_it_no_longer_sees() -> None:
    clock = JobClock()
    clock.jobs([decoding("d", 0)], NOW)
    clock.jobs([], NOW + 1)
    assert clock.jobs([decoding("d", 0)], NOW + 2)[0].ready_s == NOW + 2


# ------------------------------------------------------------------ fixed-batch
def test_fixed_batch_holds_below_b_until_the_timeout() -> None:
    policy = FixedBatch(ctx(64, timeout_ms=20))
    requests = [decoding("d0", 0), decoding("d1", 1)]
    held = policy.form_batch(requests, NOW)
    assert held.is_empty and held.hold_s == pytest.approx(0.020)
    assert policy.form_batch(requests, NOW + 0.019).hold_s == pytest.approx(0.001)
    sent = policy.form_batch(requests, NOW + 0.020)
    assert sent.decode_ids == ("d0", "d1") and not sent.hold_s


def test_fixed_batch_a_prefill_past_its_timeout_goes_at_once() -> None:
    policy = FixedBatch(ctx(64, timeout_ms=20))
    sent = policy.form_batch([waiting("w", 0, 10, arrival=NOW - 0.5)], NOW)
    assert sent.prefill_chunks == (("w", 10),)


def test_fixed_batch_dispatches_at_b_tokens_oldest_first_up_to_b() -> None:
    policy = FixedBatch(ctx(64, timeout_ms=1000))
    requests = [waiting("w2", 2, 30), waiting("w0", 0, 20), waiting("w1", 1, 40),
                waiting("w3", 3, 1)]
    sent = policy.form_batch(requests, NOW)  # 91 tokens queued >= 64
    assert sent.prefill_chunks == (("w0", 20), ("w1", 40))  # w2 would pass 64: FCFS stops
    assert sent.decode_ids == ()


def test_fixed_batch_never_cuts_a_prefill_the_oldest_goes_whole() -> None:
    policy = FixedBatch(ctx(64, timeout_ms=1000))
    sent = policy.form_batch([waiting("big", 0, 500), waiting("small", 1, 5)], NOW)
    assert sent.prefill_chunks == (("big", 500),)


def test_fixed_batch_mixes_decodes_and_prefills_by_ready_time() -> None:
    policy = FixedBatch(ctx(64, timeout_ms=5))
    policy.form_batch([decoding("d", 0)], NOW - 0.01)  # d's token became ready then
    late = waiting("w", 1, 8, arrival=NOW - 0.001)
    sent = policy.form_batch([decoding("d", 0), late], NOW)
    assert sent.decode_ids == ("d",) and sent.prefill_chunks == (("w", 8),)


def test_fixed_batch_holds_the_gpu_idle_in_the_engine() -> None:
    """A held step idles: two decodes wait exactly the timeout between tokens instead of
    the engine's fallback of running every decode; an arrival ends a hold early."""
    profile = study_profile()
    policy = POLICIES.get("fixed-batch")(ctx(128, timeout_ms=30))
    engine = SimEngine(profile, policy, record_tokens=True, check_invariants=True)
    engine.submit("a", 0.0, 16, 4, SLO)
    engine.submit("b", 0.0, 16, 4, SLO)
    engine.run_until_idle(10.0)
    times = sorted({event.time_s for event in engine.drain_tokens()})
    assert times == pytest.approx([0.030 + 0.0025 + k * 0.0325 for k in range(4)])
    engine.submit("c", 1.0, 16, 2, SLO)
    engine.advance_to(1.010)  # held: the queued 16 tokens are under b
    engine.submit("big", 1.010, 200, 2, SLO)  # 216 tokens >= b: a batch goes now
    engine.advance_to(1.05)
    first = {event.req_id: event.time_s for event in engine.drain_tokens() if event.index == 0}
    # c alone (c + big would pass b), then big alone: S(16) = 2.5 ms, S(200) = 10.9 ms
    assert first == pytest.approx({"c": 1.0125, "big": 1.0125 + 0.0025 + 50e-6 * 168})


def test_a_hold_without_a_horizon_idles_one_tick() -> None:
    policy = POLICIES.get("fixed-batch")(ctx(128, timeout_ms=30))
    engine = SimEngine(study_profile(), policy)
    engine.submit("a", 0.0, 16, 4, SLO)
    engine.step()
    assert engine.now == pytest.approx(IDLE_TICK_S) and engine.steps == 0


# ------------------------------------------------------------------ dynamic-batch
def test_dynamic_batch_target_follows_queue_depth() -> None:
    policy = DynamicBatch(ctx(256, low=2, high=5))
    assert [policy.target_tokens(depth) for depth in (1, 2, 3, 4, 5, 9)] == [
        64, 64, 128, 128, 256, 256]
    collapsed = DynamicBatch(ctx(256, low=8, high=4))
    assert [collapsed.target_tokens(depth) for depth in (3, 4, 8, 9)] == [64, 256, 256, 256]


def test_dynamic_batch_dispatches_at_the_depth_target() -> None:
    policy = DynamicBatch(ctx(256, low=2, high=5, latency_ms=1000))
    assert policy.form_batch([waiting("w", 0, 63, arrival=NOW)], NOW).hold_s > 0.9
    assert policy.form_batch([waiting("w", 0, 64, arrival=NOW)], NOW).prefill_chunks == (("w", 64),)
    three = [waiting(f"w{i}", i, 40, arrival=NOW) for i in range(3)]  # depth 3: target 128
    assert policy.form_batch(three, NOW).hold_s > 0.9
    four = [*three, waiting("w3", 3, 10, arrival=NOW)]  # 130 tokens
    assert len(policy.form_batch(four, NOW).prefill_chunks) == 4


def test_dynamic_batch_latency_guard_counts_the_predicted_step() -> None:
    """Two decodes: the batch is predicted at 5 + 2 * 0.1 = 5.2 ms; with a 50 ms target
    the guard dispatches once the oldest has waited 44.8 ms, not 50."""
    policy = DynamicBatch(ctx(256, latency_ms=50))
    requests = [decoding("d0", 0), decoding("d1", 1)]
    assert policy.form_batch(requests, NOW).hold_s == pytest.approx(0.0448)
    assert policy.form_batch(requests, NOW + 0.0447).hold_s == pytest.approx(0.0001)
    sent = policy.form_batch(requests, NOW + 0.0449)
    assert sent.decode_ids == ("d0", "d1")


def test_dynamic_batch_caps_the_batch_at_its_size() -> None:
    policy = DynamicBatch(ctx(64, latency_ms=1000))
    requests = [waiting(f"w{i}", i, 30, arrival=NOW) for i in range(20)]
    sent = policy.form_batch(requests, NOW)
    assert sent.prefill_chunks == (("w0", 30), ("w1", 30))


# ------------------------------------------------------------------ fcfs-complete
def test_fcfs_complete_serves_the_oldest_alone_to_completion() -> None:
    policy = FcfsToCompletion(ctx())
    head = waiting("head", 0, 5000)
    others = [decoding("d", 3), waiting("w", 1, 10)]
    assert policy.form_batch([*others, head], NOW) == BatchDecision((), (("head", 5000),))
    mid = decoding("head", 0, index=7)
    assert policy.form_batch([*others, mid], NOW) == BatchDecision(("head",), ())
    assert policy.form_batch([partial("p", 2, 100, 50), decoding("d", 3)], NOW) == BatchDecision(
        (), (("p", 50),))


def test_fcfs_complete_runs_one_request_at_a_time_in_the_engine() -> None:
    profile = study_profile()
    policy = POLICIES.get("fcfs-complete")(ctx())
    engine = SimEngine(profile, policy, record_steps=True, record_tokens=True)
    engine.submit(0, 0.0, 128, 3, SLO)
    engine.submit(1, 0.0, 64, 3, SLO)
    engine.run_until_idle(10.0)
    assert [(s.prefill_tokens, s.decodes) for s in engine.step_log] == [
        (128, 0), (0, 1), (0, 1), (64, 0), (0, 1), (0, 1)]
    assert [e.req_id for e in engine.drain_tokens()] == [0, 0, 0, 1, 1, 1]
    # S(128) + 2 S(1), then S(64) + 2 S(1): 7.3 + 5 + 4.1 + 5 ms
    assert engine.now == pytest.approx(0.0214)


# ------------------------------------------------------------------ prefill-first
def test_prefill_first_any_pending_prefill_makes_a_prefill_only_step() -> None:
    policy = PrefillFirst(ctx(128, chunk=32))
    requests = [decoding("d", 0), waiting("w2", 2, 100), partial("p1", 1, 50, 10),
                waiting("w3", 3, 20), waiting("w4", 4, 500), waiting("w5", 5, 40)]
    sent = policy.form_batch(requests, NOW)
    assert sent.decode_ids == ()
    # FCFS by arrival, each at most 32, the step at most 128, the last cut to what is left
    assert sent.prefill_chunks == (("p1", 10), ("w2", 32), ("w3", 20), ("w4", 32), ("w5", 32))
    assert sum(n for _, n in sent.prefill_chunks) == 126


def test_prefill_first_fills_the_budget_cutting_the_last_chunk() -> None:
    policy = PrefillFirst(ctx(128))
    sent = policy.form_batch([waiting("a", 0, 100), waiting("b", 1, 100)], NOW)
    assert sent.prefill_chunks == (("a", 100), ("b", 28))


def test_prefill_first_decodes_the_oldest_k_when_no_prefill_waits() -> None:
    policy = PrefillFirst(ctx(4))
    requests = [decoding(f"d{i}", i) for i in (5, 3, 0, 4, 1, 2)]
    assert policy.form_batch(requests, NOW) == BatchDecision(("d0", "d1", "d2", "d3"), ())


# ------------------------------------------------------------------ the service curve
def test_service_curve_is_c_plus_a_past_b0() -> None:
    gpu = make_gpu(study_profile())
    assert isinstance(gpu, ServiceCurveGpu)

    def seconds(prefill: int = 0, decodes: int = 0) -> float:
        chunks = [(prefill, 7000)] if prefill else []
        return gpu.ideal_step_s(StepShape.from_requests(chunks, [9000] * decodes))

    assert seconds(decodes=1) == pytest.approx(0.0025)
    assert seconds(prefill=32) == pytest.approx(0.0025)  # b0 = 32: no marginal cost yet
    assert seconds(prefill=33) == pytest.approx(0.0025 + 50e-6)
    assert seconds(prefill=128) == pytest.approx(0.0073)
    assert seconds(prefill=100, decodes=28) == pytest.approx(0.0073)  # b counts decodes too
    shape = StepShape.from_requests([(500, 0)])
    assert gpu.measure_step_s(shape) == gpu.ideal_step_s(shape) == pytest.approx(0.0259)
    parts = gpu.breakdown(shape)
    assert (parts.overhead_s, parts.attention_s) == (0.0025, 0.0)
    assert parts.total_s == pytest.approx(0.0259)
    with pytest.raises(ValueError, match="empty step"):
        gpu.ideal_step_s(StepShape(0, 0.0, 0, 0, 0))


def test_service_curve_exponential_marginal_keeps_the_mean() -> None:
    profile = study_profile()
    service = ServiceSpec(2.5, 50.0, 32, "exponential")
    exponential = type(profile)(profile.name, profile.model, profile.gpu, profile.runtime, service)
    shape = StepShape.from_requests([(132, 0)])  # 100 tokens past b0: mean 2.5 + 5 ms
    gpu, again = ServiceCurveGpu(exponential, seed=3), ServiceCurveGpu(exponential, seed=3)
    draws = np.array([gpu.measure_step_s(shape) for _ in range(4000)])
    assert np.array_equal(draws, [again.measure_step_s(shape) for _ in range(4000)])
    assert draws.min() >= 0.0025 and draws.std() > 0.004
    assert draws.mean() == pytest.approx(0.0075, rel=0.05)
    assert gpu.ideal_step_s(shape) == pytest.approx(0.0075)


def test_profiles_without_service_keep_the_roofline() -> None:
    assert llama().service is None
    assert type(make_gpu(llama())) is RooflineGpu
    assert type(SimEngine(llama(), FcfsToCompletion(ctx())).gpu) is RooflineGpu


def test_the_offline_knee_fit_recovers_the_curve() -> None:
    """Policies start from a fit to the curve's measured steps: the knee form is the curve."""
    model = offline_step_model(study_profile(), "knee").model
    assert model.knee_tokens == pytest.approx(32, rel=0.05)
    for tokens in (8, 128, 2048):
        shape = StepShape.from_requests([(tokens, 0)])
        assert model.predict_step(shape) == pytest.approx(
            0.0025 + 50e-6 * max(0, tokens - 32), rel=0.02)


def test_service_table_is_validated(tmp_path: Path) -> None:
    text = bundled_profile_path("des-study").read_text()
    assert load_profile(bundled_profile_path("des-study")).service == ServiceSpec(2.5, 50.0, 32)
    for old, new, field in [
        ("setup_ms = 2.5", "setup_ms = 0", "service.setup_ms"),
        ("per_token_us = 50.0", "per_token_us = -1", "service.per_token_us"),
        ("threshold_tokens = 32", "threshold_tokens = 3.5", "service.threshold_tokens"),
        ('marginal = "fixed"', 'marginal = "gamma"', "service.marginal"),
        ("setup_ms = 2.5", "setup_ms = 2.5\nsetup_us = 1", "service.setup_us"),
    ]:
        path = tmp_path / "p.toml"
        path.write_text(text.replace(old, new))
        with pytest.raises(ProfileError, match=field.replace(".", r"\.")):
            load_profile(path)


def test_service_profile_round_trips_through_toml(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(study_profile()))
    assert load_profile(path) == study_profile()


# ------------------------------------------------------------------ tuning axes


def bump(value: float, best: float) -> float:
    return math.exp(-(math.log(value / best)) ** 2)


@pytest.mark.parametrize("name, bests", [
    ("fixed-batch", {"budget": 90, "timeout_ms": 9.0}),
    ("prefill-first", {"budget": 300, "chunk": 40}),
    ("dynamic-batch", {"budget": 700, "low": 1.5, "high": 40.0, "latency_ms": 120.0}),
])
def test_each_tunable_is_tuned_to_an_interior_best(name: str, bests: dict) -> None:
    def score(spec) -> tuple[float, float]:
        values = {"budget": spec.token_budget, **dict(spec.settings)}
        return math.prod(bump(values[axis], best) for axis, best in bests.items()), 0.0

    context = PolicyContext(global_slo=SLO, initial_step_model=MODEL)
    result = drive(tune(name, context, None), score)
    best = parse_policy(result.best)
    found = {"budget": best.token_budget, **dict(best.settings)}
    assert result.edge == [] and set(found) == set(bests)
    for axis, target in bests.items():
        tried = sorted({({"budget": s.token_budget, **dict(s.settings)})[axis]
                        for s in map(parse_policy, result.tried)})
        index = tried.index(found[axis])
        assert 0 < index < len(tried) - 1, axis  # interior: a value tried on either side
        assert tried[index + 1] - found[axis] <= REFINE_STEP * found[axis] + 1, axis
        assert found[axis] == pytest.approx(target, rel=0.3), axis
        if axis in INTEGER_SETTINGS:
            assert all(float(v).is_integer() for v in tried)


def test_tuning_starts_each_axis_at_the_policy_default() -> None:
    context = PolicyContext(global_slo=SLO, initial_step_model=MODEL)
    first = next(tune("dynamic-batch", context, None))
    specs = [dict(parse_policy(label).settings) for label in first]
    assert sorted(s["low"] for s in specs) == [1, 2, 4, 8, 16]  # 4 x 1/4 .. 4
    assert all((s["high"], s["latency_ms"]) == (16, 50) for s in specs)  # others at defaults
    assert {parse_policy(label).token_budget for label in first} == {512}
    first = next(tune("prefill-first", context, None))
    assert sorted(dict(parse_policy(label).settings)["chunk"] for label in first) == [
        128, 256, 512, 1024, 2048]
    first = next(tune("fixed-batch", context, None))
    assert sorted(dict(parse_policy(label).settings)["timeout_ms"] for label in first) == [
        6.25, 12.5, 25, 50, 100]


def test_a_monotone_setting_ends_at_its_bound_as_an_edge() -> None:
    context = PolicyContext(global_slo=SLO, initial_step_model=MODEL)
    result = drive(tune("fixed-batch", context, (64, 128)),
                   lambda spec: (-dict(spec.settings)["timeout_ms"], 0.0))
    best = parse_policy(result.best)
    assert dict(best.settings)["timeout_ms"] == pytest.approx(25 / 16, abs=1e-3)
    assert result.edge == ["budget", "timeout_ms"]


def test_a_one_setting_family_keeps_its_search_label_for_label() -> None:
    """The generalised coordinate search runs sarathi-queue-timeout exactly as before it:
    the timeout grid at the start budget, then the budget, then the timeout again."""
    context = PolicyContext(global_slo=SLO, initial_step_model=MODEL)
    result = drive(tune("sarathi-queue-timeout", context, (100, 300)),
                   lambda spec: (spec.token_budget + dict(spec.settings)["timeout"], 0.0))
    grid = [f"sarathi-queue-timeout@300,timeout={t}" for t in ("0.5", "1", "2", "4", "8")]
    assert result.tried == [*grid, *(f"sarathi-queue-timeout@300,timeout={t}"
                                     for t in ("16", "32", "24")),
                            "sarathi-queue-timeout@100,timeout=32"]
    assert result.best == "sarathi-queue-timeout@300,timeout=32"
    assert result.edge == ["budget", "timeout"]


# ------------------------------------------------------------------ end to end
@pytest.mark.parametrize("name", STUDY)
@pytest.mark.slow
def test_run_on_defaults_through_the_cli(name: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = main(["run", "--policy", name, "--profile", "des-study", "--head-seconds", "30",
                 "--rate", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    document = json.loads((out / "results.json").read_text())
    assert document["scenario"]["profile"] == "des-study"
    (load,) = document["policies"][name]["loads"]
    assert load["requests"] >= 20 and load["unfinished"] == 0 and load["rejected"] == 0
    assert load["steps"] > load["requests"] and 0.0 < load["gpu_busy_fraction"] <= 1.0
    assert name in capsys.readouterr().out

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sglang_ext.sim.workloads import (
    FORMATS,
    TraceRequest,
    Workload,
    WorkloadError,
    bundled_sample,
    gamma_arrivals,
    load_workload,
    parse_arrivals,
    poisson_arrivals,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def shape(workload: Workload) -> list[tuple[float, int, int, str | None]]:
    return [
        (round(r.arrival_s, 6), r.prompt_tokens, r.output_tokens, r.slo_class)
        for r in workload.requests
    ]


def make(arrivals: list[float]) -> Workload:
    requests = tuple(TraceRequest(t, 10 + i, 1 + i) for i, t in enumerate(arrivals))
    return Workload(requests, "test")


# Loaders


def test_azure_loader_sorts_shifts_and_drops_zero_token_rows() -> None:
    workload = load_workload(FIXTURES / "azure_small.csv", "azure")
    assert shape(workload) == [
        (0.0, 374, 44, None),
        (2.541877, 879, 55, None),
        (4.314579, 396, 109, None),
        (15.0, 1200, 300, None),
    ]
    assert workload.dropped == 2
    assert workload.source == str(FIXTURES / "azure_small.csv")


def test_burstgpt_loader_reads_columns_by_name() -> None:
    workload = load_workload(FIXTURES / "burstgpt_small.csv", "burstgpt")
    assert shape(workload) == [(0.0, 472, 120, None), (1.25, 10, 33, None), (7.0, 1000, 250, None)]
    assert workload.dropped == 1


def test_mooncake_loader_converts_milliseconds() -> None:
    workload = load_workload(str(FIXTURES / "mooncake_small.jsonl"), "mooncake")
    assert shape(workload) == [(0.0, 6472, 26, None), (1.0, 6955, 52, None), (3.0, 8, 4, None)]
    assert workload.dropped == 1


def test_plain_jsonl_loader_keeps_slo_class_and_stable_order() -> None:
    workload = load_workload(FIXTURES / "plain_small.jsonl", "jsonl")
    assert shape(workload) == [
        (0.0, 2048, 512, "batch"),
        (0.5, 128, 16, "interactive"),
        (0.5, 64, 8, None),
        (3.0, 1, 1, "interactive"),
    ]
    assert workload.dropped == 0


def test_bundled_sample() -> None:
    workload = bundled_sample()
    assert len(workload.requests) > 1000
    assert workload.requests[0].arrival_s == 0.0
    assert 590.0 < workload.duration_s < 600.0
    assert workload.dropped == 0
    assert workload.source.endswith("azure_conv_sample.csv")


# Workload operations


def test_workload_sorts_and_rejects_empty() -> None:
    assert [r.arrival_s for r in make([3.0, 1.0, 2.0]).requests] == [1.0, 2.0, 3.0]
    with pytest.raises(WorkloadError, match="no requests"):
        Workload((), "empty")


def test_trace_request_validates() -> None:
    with pytest.raises(WorkloadError):
        TraceRequest(0.0, 0, 1)
    with pytest.raises(WorkloadError):
        TraceRequest(-1.0, 1, 1)


def test_duration_and_mean_rate() -> None:
    workload = make([0.0, 1.0, 2.0, 4.0])
    assert workload.duration_s == 4.0
    assert workload.mean_rate == 0.75
    for bad in (make([0.0]), make([2.0, 2.0])):
        with pytest.raises(WorkloadError, match="mean rate"):
            _ = bad.mean_rate


def test_head_is_relative_to_first_arrival() -> None:
    workload = make([5.0, 6.0, 7.0, 8.0])
    assert [r.arrival_s for r in workload.head(2.0).requests] == [5.0, 6.0]
    assert len(workload.head(0.5).requests) == 1
    for bad in (0.0, -1.0):
        with pytest.raises(WorkloadError):
            workload.head(bad)


def test_skip_keeps_a_later_window() -> None:
    workload = make([5.0, 6.0, 7.0, 8.0])
    later = workload.skip(2.0)
    assert [r.arrival_s for r in later.requests] == [7.0, 8.0]
    assert [r.arrival_s for r in later.head(1.0).requests] == [7.0]
    assert later.source.endswith("[2s:]")
    assert workload.skip(0.0).requests == workload.requests
    with pytest.raises(WorkloadError, match="no request arrives 9 s or later"):
        workload.skip(9.0)
    with pytest.raises(WorkloadError):
        workload.skip(-1.0)


def test_scaled_to_rate_is_exact_and_starts_at_zero() -> None:
    workload = load_workload(FIXTURES / "azure_small.csv", "azure")
    scaled = workload.scaled_to_rate(7.5)
    assert scaled.mean_rate == pytest.approx(7.5, rel=1e-12)
    assert scaled.requests[0].arrival_s == 0.0
    assert [r.prompt_tokens for r in scaled.requests] == [
        r.prompt_tokens for r in workload.requests
    ]
    shifted = make([10.0, 11.0, 14.0]).scaled_to_rate(1.0)
    assert [r.arrival_s for r in shifted.requests] == [0.0, 0.5, 2.0]
    with pytest.raises(WorkloadError, match="rate"):
        workload.scaled_to_rate(0.0)


@pytest.mark.parametrize("spec", ["poisson", "gamma:2.0"])
def test_with_arrivals_keeps_lengths_in_order(spec: str) -> None:
    workload = bundled_sample()
    retimed = workload.with_arrivals(spec, rate=20.0, seed=3)
    assert [(r.prompt_tokens, r.output_tokens) for r in retimed.requests] == [
        (r.prompt_tokens, r.output_tokens) for r in workload.requests
    ]
    assert retimed.requests[0].arrival_s == 0.0
    assert retimed.mean_rate == pytest.approx(20.0, rel=0.1)
    assert retimed == workload.with_arrivals(spec, rate=20.0, seed=3)


def test_with_arrivals_trace_rescales() -> None:
    workload = load_workload(FIXTURES / "burstgpt_small.csv", "burstgpt")
    assert workload.with_arrivals("trace", 4.0, seed=0).mean_rate == pytest.approx(4.0)
    with pytest.raises(WorkloadError, match="gamma:CV"):
        workload.with_arrivals("uniform", 4.0, seed=0)


# Arrival processes


def test_poisson_arrivals_statistics() -> None:
    times = poisson_arrivals(rate=5.0, n=20000, seed=7)
    gaps = np.diff(times)
    assert times[0] == 0.0 and len(times) == 20000 and np.all(gaps >= 0)
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_arrivals_statistics(cv: float) -> None:
    times = gamma_arrivals(rate=5.0, cv=cv, n=20000, seed=11)
    gaps = np.diff(times)
    assert times[0] == 0.0 and len(times) == 20000
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_arrivals_are_reproducible_by_seed() -> None:
    assert np.array_equal(poisson_arrivals(2.0, 100, 1), poisson_arrivals(2.0, 100, 1))
    assert not np.array_equal(poisson_arrivals(2.0, 100, 1), poisson_arrivals(2.0, 100, 2))
    assert np.array_equal(gamma_arrivals(2.0, 3.0, 100, 1), gamma_arrivals(2.0, 3.0, 100, 1))
    assert not np.array_equal(gamma_arrivals(2.0, 3.0, 100, 1), gamma_arrivals(2.0, 3.0, 100, 2))


def test_arrival_argument_errors() -> None:
    with pytest.raises(WorkloadError, match="rate"):
        poisson_arrivals(0.0, 10, 0)
    with pytest.raises(WorkloadError, match="n=0"):
        poisson_arrivals(1.0, 0, 0)
    with pytest.raises(WorkloadError, match="CV"):
        gamma_arrivals(1.0, 0.0, 10, 0)
    with pytest.raises(WorkloadError, match="rate"):
        gamma_arrivals(float("nan"), 1.0, 10, 0)


def test_parse_arrivals() -> None:
    assert parse_arrivals("trace") == ("trace", None)
    assert parse_arrivals("poisson") == ("poisson", None)
    assert parse_arrivals("gamma:2") == ("gamma", 2.0)
    assert parse_arrivals("gamma:0.25") == ("gamma", 0.25)


@pytest.mark.parametrize(
    "spec",
    ["", "gamma", "gamma:", "gamma:0", "gamma:-1", "gamma:x", "gamma:inf", "uniform", "poisson:2"],
)
def test_parse_arrivals_rejects_with_valid_forms(spec: str) -> None:
    with pytest.raises(WorkloadError) as info:
        parse_arrivals(spec)
    message = str(info.value)
    assert "'trace'" in message and "'poisson'" in message and "gamma:CV" in message


# Bad input

AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
MOONCAKE_ROW = '{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
PLAIN_ROW = '{"arrival_s": 0.0, "prompt_tokens": 5, "output_tokens": 2}\n'

BAD_INPUTS = [
    (
        "azure",
        "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,3\n",
        1,
        "missing column 'GeneratedTokens' (header: TIMESTAMP, ContextTokens)",
    ),
    ("azure", AZURE_HEAD + AZURE_ROW + "yesterday,3,4\n", 3, "bad timestamp"),
    ("azure", AZURE_HEAD + AZURE_ROW + "2023-11-16 18:15:47.12x,3,4\n", 3, "bad timestamp"),
    ("azure", AZURE_HEAD + "2023-11-16 18:15:46.1,abc,4\n", 2, "'ContextTokens' is not a number"),
    ("azure", AZURE_HEAD + "2023-11-16 18:15:46.1,3,-4\n", 2, "'GeneratedTokens' must be finite"),
    ("azure", AZURE_HEAD + AZURE_ROW + "2023-11-16 18:15:46.1,3\n", 3, "expected 3 fields"),
    ("burstgpt", "Timestamp,Request tokens,Response tokens\n-1.0,3,4\n", 2, "'Timestamp' must"),
    ("burstgpt", "Timestamp,Request tokens,Response tokens\n1.0,3,4.5\n", 2, "must be an integer"),
    (
        "burstgpt",
        "Timestamp,Model,Response tokens\n1.0,x,4\n",
        1,
        "missing column 'Request tokens'",
    ),
    ("mooncake", MOONCAKE_ROW + "\n" + '{"timestamp": 1,\n', 3, "invalid JSON"),
    (
        "mooncake",
        '{"timestamp": 0, "input_length": "5", "output_length": 2}\n',
        1,
        "'input_length' must be a number, got '5'",
    ),
    (
        "mooncake",
        MOONCAKE_ROW + '{"timestamp": 1, "input_length": 5.5, "output_length": 2}\n',
        2,
        "'input_length' must be an integer",
    ),
    (
        "mooncake",
        MOONCAKE_ROW + '{"timestamp": 1, "input_length": 5}\n',
        2,
        "missing key 'output_length'",
    ),
    ("mooncake", "[1, 2, 3]\n", 1, "expected a JSON object, got list"),
    (
        "jsonl",
        PLAIN_ROW + '{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 2, "slo_class": 3}\n',
        2,
        "'slo_class' must be a string",
    ),
    (
        "jsonl",
        '{"arrival_s": 1, "prompt_tokens": true, "output_tokens": 2}\n',
        1,
        "'prompt_tokens' must be a number",
    ),
    (
        "jsonl",
        '{"arrival_s": NaN, "prompt_tokens": 5, "output_tokens": 2}\n',
        1,
        "'arrival_s' must be finite",
    ),
]


@pytest.mark.parametrize(("fmt", "content", "line", "what"), BAD_INPUTS)
def test_bad_input_names_file_and_line(
    tmp_path: Path, fmt: str, content: str, line: int, what: str
) -> None:
    path = tmp_path / f"bad.{fmt}"
    path.write_text(content)
    with pytest.raises(WorkloadError) as info:
        load_workload(path, fmt)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert what in message


@pytest.mark.parametrize(
    ("fmt", "content", "what"),
    [
        ("azure", "", "empty file"),
        ("jsonl", "\n  \n", "empty file"),
        ("azure", AZURE_HEAD, "no usable rows (0 dropped"),
        ("azure", AZURE_HEAD + "2023-11-16 18:15:46.1,3,0\n", "no usable rows (1 dropped"),
    ],
)
def test_empty_input(tmp_path: Path, fmt: str, content: str, what: str) -> None:
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(WorkloadError) as info:
        load_workload(path, fmt)
    assert str(info.value).startswith(f"{path}: ") and what in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.csv"
    with pytest.raises(WorkloadError, match="no such file") as info:
        load_workload(path, "azure")
    assert str(path) in str(info.value)


def test_unknown_format_lists_formats() -> None:
    with pytest.raises(WorkloadError) as info:
        load_workload(FIXTURES / "azure_small.csv", "sharegpt")
    assert all(fmt in str(info.value) for fmt in FORMATS)
    assert "sharegpt" in str(info.value)


def test_workload_error_is_value_error() -> None:
    assert issubclass(WorkloadError, ValueError)


def test_class_mix_is_seeded_and_follows_the_fractions():
    from sglang_ext.sim.workloads import ClassMix, Workload, TraceRequest

    workload = Workload(tuple(TraceRequest(float(i), 10, 10) for i in range(2000)), "synthetic")
    mix = ClassMix.parse("a:0.25,b:0.75")
    first = workload.with_class_mix(mix, seed=3)
    assert first == workload.with_class_mix(mix, seed=3)
    assert first != workload.with_class_mix(mix, seed=4)
    share = sum(r.slo_class == "a" for r in first.requests) / len(first)
    assert 0.2 < share < 0.3
    assert [r.prompt_tokens for r in first.requests] == [r.prompt_tokens for r in workload.requests]


def test_class_mix_refuses_a_trace_with_its_own_classes():
    from sglang_ext.sim.workloads import ClassMix, Workload, TraceRequest, WorkloadError

    workload = Workload((TraceRequest(0.0, 10, 10, "x"),), "classed")
    with pytest.raises(WorkloadError, match="already name an SLO class"):
        workload.with_class_mix(ClassMix.parse("a:1"), seed=0)

"""SLO envelope (FairBatching §3.1) and the SLO spec / catalog parsing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sglang_ext.policy.slo import Slo, SloCatalog, SloError, slack

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- envelope


def test_token_deadline_first_token_is_arrival_plus_ttft() -> None:
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    # j = 0: 10.0 + 0.5
    assert slo.token_deadline(10.0, 0) == pytest.approx(10.5)


@pytest.mark.parametrize("index", [1, 2, 7, 100])
def test_token_deadline_adds_one_tpot_per_token(index: int) -> None:
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    # j = k: 10.0 + 0.5 + k * 0.05
    assert slo.token_deadline(10.0, index) == pytest.approx(10.5 + 0.05 * index)


def test_deadlines_are_evenly_spaced_by_tpot() -> None:
    slo = Slo(2.0, 0.04)
    gaps = [slo.token_deadline(3.0, j + 1) - slo.token_deadline(3.0, j) for j in range(50)]
    assert gaps == pytest.approx([0.04] * 50)


def test_slack_is_deadline_of_next_token_minus_now() -> None:
    slo = Slo(0.5, 0.05)
    # next token j=4 due at 10 + 0.5 + 4*0.05 = 10.7; at now=10.6 there are 0.1 s left
    assert slack(10.0, slo, 4, now=10.6) == pytest.approx(0.1)
    assert slack(10.0, slo, 4, now=10.6) == pytest.approx(slo.token_deadline(10.0, 4) - 10.6)


def test_slack_is_negative_when_late() -> None:
    slo = Slo(0.5, 0.05)
    # first token due at 10.5; at 10.8 it is 0.3 s late
    assert slack(10.0, slo, 0, now=10.8) == pytest.approx(-0.3)


def test_slack_of_fresh_request_is_ttft() -> None:
    assert slack(4.0, Slo(2.0, 0.05), 0, now=4.0) == pytest.approx(2.0)


def test_from_ms_converts_to_seconds() -> None:
    assert Slo.from_ms(500, 50) == Slo(0.5, 0.05)


# --------------------------------------------------------------------------- Slo validation


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "1", None, [1]]
)
@pytest.mark.parametrize("field", ["ttft_s", "tpot_s"])
def test_slo_rejects_bad_targets(field: str, bad: object) -> None:
    kwargs = {"ttft_s": 1.0, "tpot_s": 0.05, field: bad}
    with pytest.raises(SloError, match=field):
        Slo(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -5, math.nan, math.inf, True, "500", None])
def test_from_ms_rejects_bad_values(bad: object) -> None:
    with pytest.raises(SloError, match="ttft_ms"):
        Slo.from_ms(bad, 50)  # type: ignore[arg-type]
    with pytest.raises(SloError, match="tpot_ms"):
        Slo.from_ms(500, bad)  # type: ignore[arg-type]


def test_slo_error_is_a_value_error() -> None:
    assert issubclass(SloError, ValueError)


# --------------------------------------------------------------------------- catalog.resolve


@pytest.fixture
def catalog() -> SloCatalog:
    return SloCatalog(
        "standard",
        {"standard": Slo(2.0, 0.05), "interactive": Slo(0.5, 0.05), "relaxed": Slo(5.0, 0.2)},
    )


@pytest.mark.parametrize("spec", [None, {}])
def test_resolve_empty_spec_gives_default_class(catalog: SloCatalog, spec: object) -> None:
    assert catalog.resolve(spec) == Slo(2.0, 0.05)  # type: ignore[arg-type]


def test_resolve_class(catalog: SloCatalog) -> None:
    assert catalog.resolve({"class": "interactive"}) == Slo(0.5, 0.05)
    assert catalog.resolve({"class": "relaxed"}) == Slo(5.0, 0.2)


def test_resolve_explicit_ms(catalog: SloCatalog) -> None:
    assert catalog.resolve({"ttft_ms": 750, "tpot_ms": 30}) == Slo(0.75, 0.03)


def test_resolve_one_explicit_target_keeps_default_for_the_other(catalog: SloCatalog) -> None:
    # default class "standard" is 2000 ms / 50 ms
    assert catalog.resolve({"tpot_ms": 20}) == Slo(2.0, 0.02)
    assert catalog.resolve({"ttft_ms": 300}) == Slo(0.3, 0.05)


def test_resolve_class_with_override(catalog: SloCatalog) -> None:
    # relaxed is 5000/200; override TPOT only -> 5000/100
    assert catalog.resolve({"class": "relaxed", "tpot_ms": 100}) == Slo(5.0, 0.1)
    assert catalog.resolve({"class": "relaxed", "ttft_ms": 1000}) == Slo(1.0, 0.2)


def test_resolve_unknown_class_lists_defined_classes(catalog: SloCatalog) -> None:
    with pytest.raises(SloError) as info:
        catalog.resolve({"class": "platinum"})
    message = str(info.value)
    assert "'platinum'" in message
    assert "interactive, relaxed, standard" in message


def test_resolve_non_string_class(catalog: SloCatalog) -> None:
    with pytest.raises(SloError, match="unknown SLO class 3"):
        catalog.resolve({"class": 3})


def test_resolve_unknown_keys(catalog: SloCatalog) -> None:
    with pytest.raises(SloError, match=r"unknown SLO key\(s\) \['deadline', 'ttft'\]"):
        catalog.resolve({"ttft": 500, "deadline": 1, "tpot_ms": 50})


@pytest.mark.parametrize("spec", ["interactive", 500, [("class", "standard")], ("a",)])
def test_resolve_non_mapping(catalog: SloCatalog, spec: object) -> None:
    with pytest.raises(SloError, match="must be an object"):
        catalog.resolve(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec, name",
    [
        ({"ttft_ms": 0, "tpot_ms": 50}, "ttft_ms"),
        ({"ttft_ms": -1}, "ttft_ms"),
        ({"tpot_ms": "fast"}, "tpot_ms"),
        ({"tpot_ms": True}, "tpot_ms"),
        ({"class": "standard", "tpot_ms": math.nan}, "tpot_ms"),
        ({"ttft_ms": math.inf}, "ttft_ms"),
        ({"ttft_ms": None}, "ttft_ms"),
    ],
)
def test_resolve_bad_values(catalog: SloCatalog, spec: dict, name: str) -> None:
    with pytest.raises(SloError, match=name):
        catalog.resolve(spec)


def test_catalog_classes_are_read_only(catalog: SloCatalog) -> None:
    with pytest.raises(TypeError):
        catalog.classes["new"] = Slo(1, 1)  # type: ignore[index]


def test_catalog_needs_classes_and_a_defined_default() -> None:
    with pytest.raises(SloError, match="at least one class"):
        SloCatalog("x", {})
    with pytest.raises(SloError, match="'gold' is not a defined class; defined: a, b"):
        SloCatalog("gold", {"b": Slo(1, 0.1), "a": Slo(1, 0.1)})


def test_single_catalog() -> None:
    catalog = SloCatalog.single(Slo(1.0, 0.1))
    assert catalog.default_class == "default"
    assert catalog.resolve(None) == Slo(1.0, 0.1)


# --------------------------------------------------------------------------- from_toml


def test_bundled_slo_toml() -> None:
    catalog = SloCatalog.from_toml(REPO / "configs" / "slo.toml")
    assert catalog.default_class == "standard"
    assert catalog.default == Slo.from_ms(2000, 50)
    assert catalog.default.ttft_s == pytest.approx(2.0)
    assert catalog.default.tpot_s == pytest.approx(0.05)
    assert catalog.resolve({"class": "interactive"}) == Slo.from_ms(500, 50)


GOOD_CLASS = "[classes.a]\nttft_ms = 1000\ntpot_ms = 50\n"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("default_class = \n", "invalid TOML"),
        ("default_class = 'a'\n[classes.a\nttft_ms = 1\n", "invalid TOML"),
        (GOOD_CLASS, "missing string field 'default_class'"),
        ("default_class = 7\n" + GOOD_CLASS, "missing string field 'default_class'"),
        ("default_class = 'b'\n" + GOOD_CLASS, "'b' is not a defined class; defined: a"),
        ("default_class = 'a'\n", "missing table 'classes'"),
        ("default_class = 'a'\n[classes.a]\nttft_ms = 1000\n", "[classes.a] must have exactly"),
        (
            "default_class = 'a'\n[classes.a]\nttft_ms = 1000\ntpot_ms = 50\nburst = 1\n",
            "[classes.a] must have exactly",
        ),
        ("default_class = 'a'\n[classes.a]\nttft_ms = 0\ntpot_ms = 50\n", "[classes.a]: ttft_ms"),
        ("default_class = 'a'\n[classes.a]\nttft_ms = 10\ntpot_ms = -5\n", "[classes.a]: tpot_ms"),
        ("default_class = 'a'\nextra = 1\n" + GOOD_CLASS, "unknown top-level key(s) ['extra']"),
    ],
    ids=[
        "invalid-value",
        "unclosed-table",
        "missing-default",
        "default-not-string",
        "default-undefined",
        "no-classes",
        "missing-tpot",
        "extra-field",
        "zero-ttft",
        "negative-tpot",
        "unknown-top-level",
    ],
)
def test_from_toml_errors_name_the_file(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "my-slo.toml"
    path.write_text(text)
    with pytest.raises(SloError) as info:
        SloCatalog.from_toml(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert fragment in message, message


def test_from_toml_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(SloError, match="no such SLO file") as info:
        SloCatalog.from_toml(path)
    assert str(path) in str(info.value)


def test_from_toml_round_trip_of_a_small_file(tmp_path: Path) -> None:
    path = tmp_path / "slo.toml"
    path.write_text(
        "default_class = 'b'\n"
        "[classes.a]\nttft_ms = 1000\ntpot_ms = 50\n"
        "[classes.b]\nttft_ms = 250.5\ntpot_ms = 20\n"
    )
    catalog = SloCatalog.from_toml(path)
    assert catalog.default == Slo(0.2505, 0.02)
    assert set(catalog.classes) == {"a", "b"}

"""SLO envelope (FairBatching §3.1) and the SLO spec / catalog parsing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sglang_ext.policy.slo import (
    E2E_TTFT_SHARE, NOMINAL_OUTPUT_TOKENS, Slo, SloCatalog, SloError, slack,
)

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


# --------------------------------------------------------------------------- the e2e kind


def test_e2e_slo_kind() -> None:
    assert Slo(0.5, 0.1, 2.0).is_end_to_end
    assert not Slo(0.5, 0.1).is_end_to_end
    assert Slo(0.5, 0.1).e2e_s is None


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "2", [2.0]])
def test_slo_rejects_bad_e2e_targets(bad: object) -> None:
    with pytest.raises(SloError, match="e2e_s"):
        Slo(0.5, 0.1, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("ttft_s", [2.0, 3.0])
def test_an_e2e_slo_needs_its_first_token_budget_below_its_target(ttft_s: float) -> None:
    with pytest.raises(SloError, match=r"first-token budget .* must be below its e2e target"):
        Slo(ttft_s, 0.1, 2.0)


def test_end_to_end_ms_defaults_the_first_token_budget_to_a_share_of_the_target() -> None:
    slo = Slo.end_to_end_ms(16_000)
    assert slo.e2e_s == 16.0
    assert slo.ttft_s == E2E_TTFT_SHARE * 16.0 == 4.0
    # NOMINAL_OUTPUT_TOKENS expected: the remaining 255 tokens paced over the last 12 s
    assert slo.tpot_s == pytest.approx(12.0 / (NOMINAL_OUTPUT_TOKENS - 1))
    assert Slo.end_to_end_ms(16_000, 1000).ttft_s == 1.0


@pytest.mark.parametrize("expected", [2, 3, 100, 256, 257, 1000, 4097])
def test_the_last_expected_token_is_due_at_arrival_plus_e2e(expected: int) -> None:
    slo = Slo.end_to_end_ms(14_000, expected_output_tokens=expected)
    arrival = 7.5
    assert slo.token_deadline(arrival, 0) == arrival + slo.ttft_s
    assert slo.token_deadline(arrival, expected - 1) == pytest.approx(arrival + 14.0, abs=1e-12)
    steps = [slo.token_deadline(arrival, j + 1) - slo.token_deadline(arrival, j)
             for j in range(expected - 1)]
    assert steps == pytest.approx([slo.tpot_s] * (expected - 1))  # evenly paced


def test_pacing_is_exact_in_binary_fractions() -> None:
    slo = Slo(4.0, 1.0, 16.0).with_expected_output(257)  # 12 s over 256 gaps
    assert slo.tpot_s == 12.0 / 256
    assert slo.token_deadline(0.0, 256) == 16.0


def test_with_expected_output_keeps_the_targets_and_is_idempotent() -> None:
    base = Slo.end_to_end_ms(10_000, 2000)
    paced = base.with_expected_output(81)
    assert (paced.ttft_s, paced.e2e_s) == (base.ttft_s, base.e2e_s)
    assert paced.tpot_s == pytest.approx(8.0 / 80)
    assert paced.with_expected_output(81) == paced
    assert base.with_expected_output(NOMINAL_OUTPUT_TOKENS) == base
    # one expected token (or fewer): the first token alone, the rest due by the target
    for tokens in (1, 0.5, 0):
        assert base.with_expected_output(tokens).tpot_s == pytest.approx(8.0)


def test_with_expected_output_leaves_a_ttft_tpot_slo_alone() -> None:
    slo = Slo(2.0, 0.05)
    assert slo.with_expected_output(17) is slo


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"e2e_ms": 0}, "e2e_ms"),
        ({"e2e_ms": -5}, "e2e_ms"),
        ({"e2e_ms": "fast"}, "e2e_ms"),
        ({"e2e_ms": math.nan}, "e2e_ms"),
        ({"e2e_ms": 1000, "ttft_ms": 0}, "ttft_ms"),
        ({"e2e_ms": 1000, "ttft_ms": 1000}, "ttft_ms 1000 must be below e2e_ms 1000"),
        ({"e2e_ms": 1000, "ttft_ms": 1500}, "must be below"),
    ],
)
def test_end_to_end_ms_rejects_bad_values(kwargs: dict, fragment: str) -> None:
    with pytest.raises(SloError, match=fragment):
        Slo.end_to_end_ms(**kwargs)


@pytest.mark.parametrize("slo", [Slo.from_ms(500, 40), Slo.end_to_end_ms(9000),
                                 Slo.end_to_end_ms(9000, 700)])
def test_as_spec_resolves_back_to_the_slo(slo: Slo) -> None:
    assert SloCatalog.single(Slo(1.0, 0.1)).resolve(slo.as_spec()) == slo


def test_as_spec_of_each_kind() -> None:
    assert Slo.from_ms(500, 40).as_spec() == {"ttft_ms": 500.0, "tpot_ms": 40.0}
    assert Slo.end_to_end_ms(8000).as_spec() == {"e2e_ms": 8000.0, "ttft_ms": 2000.0}


@pytest.fixture
def mixed() -> SloCatalog:
    """chat (TTFT+TPOT, the default), code (e2e with no TTFT), doc (e2e with a TTFT)."""
    return SloCatalog("chat", {
        "chat": Slo.from_ms(2000, 50),
        "code": Slo.end_to_end_ms(12_000),
        "doc": Slo.end_to_end_ms(20_000, 1000),
    })


def test_resolve_an_e2e_class(mixed: SloCatalog) -> None:
    assert mixed.resolve({"class": "code"}) == Slo.end_to_end_ms(12_000)
    doc = mixed.resolve({"class": "doc"})
    assert doc.is_end_to_end and (doc.ttft_s, doc.e2e_s) == (1.0, 20.0)


def test_resolve_e2e_ms_makes_the_slo_end_to_end(mixed: SloCatalog) -> None:
    # on the TTFT+TPOT default: the first-token budget is the e2e share, not chat's TTFT
    slo = mixed.resolve({"e2e_ms": 12_000})
    assert slo.is_end_to_end and (slo.ttft_s, slo.e2e_s) == (3.0, 12.0)
    assert mixed.resolve({"e2e_ms": 12_000, "ttft_ms": 1000}) == Slo.end_to_end_ms(12_000, 1000)


def test_resolve_overrides_of_an_e2e_class(mixed: SloCatalog) -> None:
    # ttft_ms alone keeps the class's target; e2e_ms alone keeps no stated TTFT
    assert mixed.resolve({"class": "code", "ttft_ms": 1000}) == Slo.end_to_end_ms(12_000, 1000)
    assert mixed.resolve({"class": "doc", "ttft_ms": 500}) == Slo.end_to_end_ms(20_000, 500)
    assert mixed.resolve({"class": "doc", "e2e_ms": 8000}) == Slo.end_to_end_ms(8000)
    assert mixed.resolve({"class": "doc", "e2e_ms": 8000, "ttft_ms": 100}) == \
        Slo.end_to_end_ms(8000, 100)


def test_resolve_tpot_ms_makes_the_slo_ttft_tpot(mixed: SloCatalog) -> None:
    # an e2e class given a TPOT: TTFT+TPOT, its TTFT the class's first-token budget
    assert mixed.resolve({"class": "doc", "tpot_ms": 40}) == Slo.from_ms(1000, 40)
    assert mixed.resolve({"class": "code", "tpot_ms": 40}) == Slo.from_ms(3000, 40)


def test_resolve_refuses_e2e_ms_with_tpot_ms(mixed: SloCatalog) -> None:
    for spec in ({"e2e_ms": 9000, "tpot_ms": 50}, {"class": "code", "e2e_ms": 9000, "tpot_ms": 5}):
        with pytest.raises(SloError, match="give 'e2e_ms' .* or 'tpot_ms', not both"):
            mixed.resolve(spec)


def test_resolve_unknown_keys_list_every_accepted_key(mixed: SloCatalog) -> None:
    expected = r"\['e2e'\]; expected 'class', 'ttft_ms', 'tpot_ms', 'e2e_ms'"
    with pytest.raises(SloError, match=expected):
        mixed.resolve({"e2e": 9000})


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"e2e_ms": 0}, "e2e_ms"),
        ({"e2e_ms": True}, "e2e_ms"),
        ({"e2e_ms": None}, "e2e_ms"),
        ({"class": "code", "e2e_ms": math.inf}, "e2e_ms"),
        ({"class": "code", "ttft_ms": 12_000}, "ttft_ms 12000 must be below e2e_ms 12000"),
        ({"e2e_ms": 1000, "ttft_ms": 2000}, "must be below"),
    ],
)
def test_resolve_bad_e2e_values(mixed: SloCatalog, spec: dict, fragment: str) -> None:
    with pytest.raises(SloError, match=fragment):
        mixed.resolve(spec)


def test_an_e2e_default_class(mixed: SloCatalog) -> None:
    catalog = SloCatalog("code", dict(mixed.classes))
    assert catalog.resolve(None) == catalog.default == Slo.end_to_end_ms(12_000)
    assert catalog.resolve({"ttft_ms": 500}) == Slo.end_to_end_ms(12_000, 500)
    assert catalog.resolve({"tpot_ms": 30}) == Slo.from_ms(3000, 30)


def test_bundled_multi_slo_toml() -> None:
    catalog = SloCatalog.from_toml(REPO / "configs" / "slo-multi.toml")
    assert catalog.default_class == "chat"
    assert catalog.default == Slo.from_ms(2000, 50)
    code = catalog.classes["code"]
    assert code == Slo.end_to_end_ms(14_000)
    assert (code.ttft_s, code.e2e_s) == (3.5, 14.0)


MIXED_TOML = (
    "default_class = 'chat'\n"
    "[classes.chat]\nttft_ms = 2000\ntpot_ms = 50\n"
    "[classes.code]\ne2e_ms = 30000\n"
    "[classes.doc]\ne2e_ms = 20000\nttft_ms = 1000\n"
)


def test_from_toml_of_both_kinds(tmp_path: Path) -> None:
    path = tmp_path / "slo.toml"
    path.write_text(MIXED_TOML)
    catalog = SloCatalog.from_toml(path)
    assert catalog.classes["code"] == Slo.end_to_end_ms(30_000)
    assert catalog.classes["doc"] == Slo.end_to_end_ms(20_000, 1000)
    assert not catalog.default.is_end_to_end
    path.write_text(MIXED_TOML.replace("'chat'", "'code'"))
    assert SloCatalog.from_toml(path).default == Slo.end_to_end_ms(30_000)


LAYOUT = "[classes.c] must have exactly 'ttft_ms' and 'tpot_ms' (TTFT+TPOT), or 'e2e_ms'"


@pytest.mark.parametrize(
    "table, fragment",
    [
        ("e2e_ms = 9000\ntpot_ms = 50\n", LAYOUT),
        ("e2e_ms = 9000\nttft_ms = 500\ntpot_ms = 50\n", LAYOUT),
        ("ttft_ms = 500\n", LAYOUT),
        ("e2e_ms = 9000\ndeadline = 1\n", LAYOUT),
        ("", LAYOUT),
        ("e2e_ms = 0\n", "[classes.c]: e2e_ms must be > 0"),
        ("e2e_ms = 'soon'\n", "[classes.c]: e2e_ms must be a number"),
        ("e2e_ms = 9000\nttft_ms = 9000\n", "[classes.c]: ttft_ms 9000 must be below e2e_ms 9000"),
        ("e2e_ms = 9000\nttft_ms = -1\n", "[classes.c]: ttft_ms must be > 0"),
    ],
    ids=["e2e+tpot", "e2e+ttft+tpot", "ttft-only", "unknown-key", "empty", "zero-e2e",
         "string-e2e", "ttft-at-e2e", "negative-ttft"],
)
def test_from_toml_e2e_class_errors(tmp_path: Path, table: str, fragment: str) -> None:
    path = tmp_path / "slo.toml"
    path.write_text(f"default_class = 'c'\n[classes.c]\n{table}")
    with pytest.raises(SloError) as info:
        SloCatalog.from_toml(path)
    message = str(info.value)
    assert message.startswith(str(path)) and fragment in message, message

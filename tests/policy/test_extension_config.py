"""The extension's config file and the per-request SLO key shape (pure, no SGLang)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_ext.adapter.extension_config import CONFIG_ENV, ConfigError, ExtensionConfig, load_from_environment
from sglang_ext.policy.slo import Slo, SloCatalog, SloError, slo_spec_of

REPO = Path(__file__).resolve().parents[2]
CATALOG = SloCatalog("standard", {"standard": Slo(2.0, 0.05), "chat": Slo(0.5, 0.05)})


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fairbatching.toml"
    path.write_text(text)
    return path


def test_shipped_config_loads_and_builds_its_policy() -> None:
    config = ExtensionConfig.load(REPO / "configs" / "fairbatching.toml")
    policy = config.build_policy()
    assert policy.name == config.policy
    assert config.catalog.default_class == "standard"
    assert config.initial_step_model.a_s > 0


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "slo.toml").write_text(
        'default_class = "x"\n[classes.x]\nttft_ms = 300\ntpot_ms = 30\n'
    )
    config = ExtensionConfig.load(write(tmp_path, 'slo_file = "slo.toml"\n'))
    assert config.policy == "fb"
    assert config.catalog.default == Slo(0.3, 0.03)
    assert config.max_token_budget == 8192
    assert config.gc_enabled and config.gc.min_interval_s == 30.0


def test_calibration_is_the_default_only_without_a_step_model_file(tmp_path: Path) -> None:
    (tmp_path / "slo.toml").write_text('default_class = "x"\n[classes.x]\nttft_ms = 300\ntpot_ms = 30\n')
    step_model = REPO / "configs" / "step_models" / "qwen3-14b-h20.toml"
    assert ExtensionConfig.load(write(tmp_path, 'slo_file = "slo.toml"\n')).calibrate
    named = ExtensionConfig.load(write(tmp_path, f'slo_file = "slo.toml"\nstep_model = "{step_model}"\n'))
    assert not named.calibrate and named.learn_knee
    both = ExtensionConfig.load(write(
        tmp_path, f'slo_file = "slo.toml"\nstep_model = "{step_model}"\ncalibrate = true\nlearn_knee = false\n'))
    assert both.calibrate and not both.learn_knee
    assert not both.build_policy().context.learn_knee
    for key in ("calibrate", "learn_knee"):
        with pytest.raises(ConfigError, match=f"{key} must be true or false"):
            ExtensionConfig.load(write(tmp_path, f'slo_file = "slo.toml"\n{key} = "yes"\n'))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('polcy = "fb"\n', "unknown key(s) ['polcy']"),
        ('policy = "nope"\n', "unknown policy 'nope'"),
        ('policy = "sarathi"\n', "not supported inside SGLang"),
        ("max_token_budget = 0\n", "max_token_budget must be an integer >= 1"),
        ('slo_file = "missing.toml"\n', "no such SLO file"),
        ('step_model = "missing.toml"\n', "step_model"),
        ("[gc]\nenabled = 1\n", "enabled must be true or false"),
        ("[gc]\nmin_interval_s = -1\n", "min_interval_s"),
        ("policy = [\n", "invalid TOML"),
    ],
)
def test_bad_config_names_the_file_and_the_problem(tmp_path: Path, text: str, message: str) -> None:
    if "sarathi" in text:
        import sglang_ext.sim.competitors.baselines  # noqa: F401  (registers the baselines)
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        ExtensionConfig.load(path)
    assert str(path) in str(excinfo.value)
    assert message in str(excinfo.value)


def test_environment_variable_switches_it_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert load_from_environment() is None
    monkeypatch.setenv(CONFIG_ENV, "  ")
    assert load_from_environment() is None
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match=CONFIG_ENV):
        load_from_environment()
    monkeypatch.setenv(CONFIG_ENV, str(REPO / "configs" / "fairbatching.toml"))
    assert load_from_environment() is not None


def test_custom_params_slo_shapes() -> None:
    assert CATALOG.resolve_custom_params(None) == CATALOG.default
    assert CATALOG.resolve_custom_params({"other": 1}) == CATALOG.default
    assert CATALOG.resolve_custom_params({"slo": {"class": "chat"}}) == Slo(0.5, 0.05)
    assert CATALOG.resolve_custom_params({"slo": {"ttft_ms": 100, "tpot_ms": 20}}) == Slo(0.1, 0.02)
    assert CATALOG.resolve_custom_params({"slo": {"class": "chat", "tpot_ms": 20}}) == Slo(0.5, 0.02)


@pytest.mark.parametrize(
    ("custom_params", "message"),
    [
        ([1], "custom_params must be an object"),
        ({"slo": "chat"}, "custom_params.slo must be an object"),
        ({"slo": {"class": "gold"}}, "unknown SLO class 'gold'"),
        ({"slo": {"ttft_ms": -5}}, "ttft_ms must be > 0"),
        ({"slo": {"ttft_ms": "fast"}}, "ttft_ms must be a number"),
        ({"slo": {"deadline": 3}}, "unknown SLO key"),
    ],
)
def test_malformed_custom_params_slo(custom_params: object, message: str) -> None:
    with pytest.raises(SloError, match=message):
        CATALOG.resolve_custom_params(custom_params)


def test_slo_spec_of_passes_the_inner_spec_through() -> None:
    spec = {"ttft_ms": 1, "tpot_ms": 2}
    assert slo_spec_of({"slo": spec}) is spec


def test_admission_table(tmp_path: Path) -> None:
    from sglang_ext.policy.admission import AdmissionMode, AdmissionRule

    config = ExtensionConfig.load(write(tmp_path, (
        'policy = "fb-anchor-margin"\n[admission]\nmode = "defer"\nmax_defer_s = 5\n'
        "retry_after_s = 2\nmax_budget_age_s = 0.25\nheadroom = 0\n"
    )))
    admission = config.admission
    assert (admission.mode, admission.rule) == (AdmissionMode.DEFER, AdmissionRule.EDF)
    assert (admission.max_defer_s, admission.retry_after_s) == (5.0, 2.0)
    assert (admission.max_budget_age_s, admission.headroom) == (0.25, 0.0)
    assert config.build_policy().admission == admission
    assert admission.give_up is None and admission.length_weight == 1.0
    weighted = ExtensionConfig.load(write(tmp_path, '[admission]\nmode = "defer"\ngive_up = 0.5\n'))
    assert weighted.admission.length_weight == 0.5


def test_admission_defaults_off_and_pab_names_imply_reject(tmp_path: Path) -> None:
    from sglang_ext.policy.admission import AdmissionMode, AdmissionRule

    shipped = ExtensionConfig.load(REPO / "configs" / "fairbatching.toml")
    assert shipped.admission.mode is AdmissionMode.DEFER  # shipped on; the code's default is off
    config = ExtensionConfig.load(write(tmp_path, 'policy = "fb-anchor-margin-pab"\n'))
    assert config.admission.mode is AdmissionMode.OFF
    effective = config.effective_admission
    assert (effective.mode, effective.rule) == (AdmissionMode.REJECT, AdmissionRule.PAB)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[admission]\nmood = "reject"\n', "[admission]: unknown key(s) ['mood']"),
        ('[admission]\nmode = "drop"\n', "unknown admission mode 'drop'"),
        ("[admission]\nmode = 1\n", "[admission] mode must be a string"),
        ('[admission]\nrule = "fifo"\n', "unknown admission rule 'fifo'"),
        ("[admission]\nmax_defer_s = 0\n", "max_defer_s must be a finite number > 0"),
        ('[admission]\nretry_after_s = "1"\n', "retry_after_s must be a number"),
        ("[admission]\nmax_budget_age_s = -1\n", "max_budget_age_s"),
        ("[admission]\nheadroom = 1\n", "headroom must be a number in [0, 1)"),
        ("admission = 3\n", "[admission] must be a table"),
        ('[admission]\nmode = "defer"\nrule = "pab"\n', "defer needs the per-request forecast"),
        ('[admission]\nmode = "reject"\ngive_up = "latest"\n', "mode 'reject' gives nothing up"),
        ('[admission]\ngive_up = "longest"\n', "mode 'off' gives nothing up"),
        ('[admission]\nmode = "defer"\ngive_up = "oldest"\n', "unknown admission give_up 'oldest'"),
        ('[admission]\nmode = "defer"\ngive_up = true\n',
         "[admission] give_up must be a string or a number from 0 to 1"),
        ('[admission]\nmode = "defer"\ngive_up = 1.5\n', "is not a length weight from 0"),
        ('policy = "fb-anchor-margin-pab"\n[admission]\nmode = "defer"\n',
         "policy 'fb-anchor-margin-pab' means admission mode 'reject' with rule 'pab'"),
    ],
)
def test_bad_admission_is_refused_at_load(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        ExtensionConfig.load(path)
    assert str(path) in str(excinfo.value)
    assert message in str(excinfo.value)


def test_trace_table_turns_the_step_log_on(tmp_path: Path) -> None:
    (tmp_path / "fb.toml").write_text('[trace]\nstep_log = "steps.jsonl"\n')
    assert ExtensionConfig.load(tmp_path / "fb.toml").step_log == tmp_path / "steps.jsonl"
    (tmp_path / "off.toml").write_text("[trace]\n")
    assert ExtensionConfig.load(tmp_path / "off.toml").step_log is None


@pytest.mark.parametrize("text, message", [
    ('trace = 1\n', "[trace] must be a table"),
    ('[trace]\npath = "x"\n', "unknown key(s) ['path']"),
    ('[trace]\nstep_log = 3\n', "step_log must be a path string"),
    ('[trace]\nstep_log = "no/such/dir/steps.jsonl"\n', "does not exist"),
])
def test_bad_trace_table_is_refused_at_load(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "fb.toml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        ExtensionConfig.load(tmp_path / "fb.toml")


def test_delivery_allowance_plans_tokens_earlier(tmp_path: Path) -> None:
    config = ExtensionConfig.load(write(tmp_path, 'policy = "fb-smooth"\ndelivery_allowance_ms = 15\n'))
    assert config.delivery_allowance_s == pytest.approx(0.015)
    assert config.build_policy().context.delivery_allowance_s == pytest.approx(0.015)


@pytest.mark.parametrize("text, message", [
    ('policy = "fb"\ndelivery_allowance_ms = 10\n', "takes no delivery allowance"),
    ('policy = "fb-smooth"\ndelivery_allowance_ms = -1\n', "delivery_allowance_ms must be a finite number >= 0"),
    ('policy = "fb-smooth"\ndelivery_allowance_ms = "10"\n', "delivery_allowance_ms must be a number"),
])
def test_bad_delivery_allowance_is_refused_at_load(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ExtensionConfig.load(write(tmp_path, text))

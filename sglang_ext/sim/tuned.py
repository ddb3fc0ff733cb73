"""Baseline settings tuned by a full sweep, shipped so the demo need not tune them again.

``python -m sglang_ext.sim sweep`` tunes every tunable baseline family named bare
(``sarathi``, ``sarathi-queue-cap``, ...) by a budget search (``sglang_ext.sim.fitting.tuning``)
that costs about 1,000 simulations. The full sweep (``sweep --full``) does exactly that; its
best setting per family is what a tuned-settings file records (``sweep --full --save-tuned
PATH`` writes one), with the scenario it was tuned on and where it came from. The quick
default (``sweep`` with no flag) runs each family at the file's setting instead of searching,
but only on the scenario the file was tuned on: :func:`scenario_fingerprint` names what the
tuning depends on (GPU profile, workload after its head and class mix, arrivals, SLO targets,
seed, drain, token cap, initial step model) and :meth:`TunedSettings.differences` says what
differs; any difference and the sweep tunes on its own scenario instead.

The shipped file is ``configs/tuned_baselines.toml`` (found through the package:
:data:`SHIPPED`).
"""

from __future__ import annotations

import hashlib
import json
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_ext.bundled import CONFIGS_DIR
from sglang_ext.sim.runner import Scenario, parse_policy

SHIPPED: Path = CONFIGS_DIR / "tuned_baselines.toml"
#: the demo's three-class scenario, tuned the same way
SHIPPED_THREE_CLASSES: Path = CONFIGS_DIR / "tuned_baselines_three_classes.toml"
SHIPPED_FILES: tuple[Path, ...] = (SHIPPED, SHIPPED_THREE_CLASSES)


class TunedSettingsError(ValueError):
    """A tuned-settings file that cannot be read or does not fit its use."""


def display_path(path: Path) -> str:
    """``configs/NAME`` for a file in the bundled configs, else the path as given."""
    try:
        return f"configs/{path.resolve().relative_to(CONFIGS_DIR.resolve())}"
    except ValueError:
        return str(path)


def scenario_fingerprint(scenario: Scenario) -> dict:
    """What a tuned setting depends on besides the policy code and the load grid.

    The workload enters by content (every request's arrival, token counts and class after
    the head cut and any class mix), so the same trace read from another path matches; the
    GPU profile by name and by the hash of its fields; the SLO by the default class's
    targets (every policy's global SLO) and those of every class the requests name."""
    workload = scenario.workload
    catalog = scenario.catalog
    digest = hashlib.sha256()
    for request in workload.requests:
        digest.update(f"{request.arrival_s!r},{request.prompt_tokens},{request.output_tokens},"
                      f"{request.slo_class or ''}\n".encode())
    used = {catalog.default_class} | {r.slo_class for r in workload.requests if r.slo_class}
    step_model = (f"offline {scenario.step_form} fit" if scenario.step_model is None else
                  "file " + hashlib.sha256(repr(scenario.step_model).encode()).hexdigest()[:16])
    return {
        "profile": scenario.profile.name,
        "profile_sha256": hashlib.sha256(repr(scenario.profile).encode()).hexdigest(),
        "workload": workload.source.replace("\\", "/").rsplit("/", 1)[-1],
        "requests": len(workload.requests),
        "workload_sha256": digest.hexdigest(),
        "arrivals": scenario.arrivals,
        "seed": scenario.seed,
        "drain_s": float(scenario.drain_s),
        "max_token_budget": scenario.max_token_budget,
        "step_model": step_model,
        "slo_default_class": catalog.default_class,
        "slo": {name: {key: float(value) for key, value in catalog.classes[name].as_spec().items()}
                for name in sorted(used)},
    }


#: how a difference is named, in the order reported
_FIELDS = (
    ("profile", "GPU profile"), ("profile_sha256", "GPU profile's fields"),
    ("workload_sha256", "workload"), ("arrivals", "arrivals"), ("seed", "seed"),
    ("slo_default_class", "default SLO class"), ("slo", "SLO targets"),
    ("drain_s", "drain"), ("max_token_budget", "max token budget"),
    ("step_model", "initial step model"),
)


@dataclass(frozen=True)
class TunedFamily:
    best: str  # the best setting's label, e.g. sarathi@1024
    edge_axes: tuple[str, ...] = ()  # axes whose best sits at a bound of the search
    settings_tried: int = 0
    peak_effective_rps: float | None = None  # where the full sweep found it, for the record
    peak_rate: float | None = None


@dataclass(frozen=True)
class TunedSettings:
    path: Path
    provenance: Mapping[str, object]
    scenario: Mapping[str, object]
    families: Mapping[str, TunedFamily]

    @property
    def source(self) -> str:
        return display_path(self.path)

    def differences(self, fingerprint: Mapping[str, object]) -> list[str]:
        """Each way ``fingerprint``'s scenario differs from the one the file was tuned on,
        in words (empty: the same scenario)."""
        out = []
        for key, words in _FIELDS:
            mine, theirs = self.scenario.get(key), fingerprint.get(key)
            if mine == theirs:
                continue
            if key == "profile_sha256" and self.scenario.get("profile") != fingerprint.get("profile"):
                continue  # already said: another profile
            if key == "workload_sha256":
                out.append(
                    f"workload: tuned on {self.scenario.get('workload')} "
                    f"({self.scenario.get('requests')} requests), this run "
                    f"{fingerprint.get('workload')} ({fingerprint.get('requests')} requests)"
                    + (" with other contents" if self.scenario.get("workload")
                       == fingerprint.get("workload") else "")
                )
            elif key == "profile_sha256":
                out.append(f"GPU profile {fingerprint.get('profile')}: its fields differ from "
                           "those it was tuned with")
            else:
                out.append(f"{words}: tuned on {_text(mine)}, this run {_text(theirs)}")
        return out

    def tuning_entry(self, name: str) -> dict:
        """The ``tuning`` of a family run at this file's setting, for ``results.json``."""
        family = self.families[name]
        return {
            "from": self.source,
            "shipped": any(self.path.resolve() == path.resolve() for path in SHIPPED_FILES),
            "tuned_by": self.provenance.get("command"),
            "tuned_on": self.provenance.get("date"),
            "edge_axes": list(family.edge_axes),
        }


def _text(value: object) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def load(path: Path = SHIPPED) -> TunedSettings:
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TunedSettingsError(f"{path}: {exc}") from None
    try:
        tuned = data["tuned"]
        families = {
            name: TunedFamily(
                best=entry["best"], edge_axes=tuple(entry.get("edge_axes", ())),
                settings_tried=int(entry.get("settings_tried", 0)),
                peak_effective_rps=entry.get("peak_effective_rps"),
                peak_rate=entry.get("peak_rate"),
            )
            for name, entry in tuned.items()
        }
        settings = TunedSettings(Path(path), data["provenance"], data["scenario"], families)
    except (KeyError, TypeError, ValueError) as exc:
        raise TunedSettingsError(f"{path}: not a tuned-settings file ({exc!r} missing or "
                                 "malformed; write one with `sweep --full --save-tuned`)") from None
    for name, family in families.items():
        spec = parse_policy(family.best)
        if spec.base != name or spec.is_tunable:
            raise TunedSettingsError(f"{path}: [tuned.{name}] best = {family.best!r} is not a "
                                     f"setting of {name}")
    return settings


def shipped_for(fingerprint: Mapping[str, object]) -> Path:
    """The shipped tuned-settings file tuned on the scenario of ``fingerprint``; the
    one-class file when none is (its differences then say why it does not apply)."""
    for path in SHIPPED_FILES:
        if path.is_file() and not load(path).differences(fingerprint):
            return path
    return SHIPPED


def families_of(document: Mapping) -> dict[str, TunedFamily]:
    """The tuned families of a sweep's ``results.json`` (those it searched)."""
    return {
        name: TunedFamily(
            best=entry["best_of"], edge_axes=tuple(entry["tuning"].get("edge_axes", ())),
            settings_tried=len(entry["tuning"]["tried"]),
            peak_effective_rps=entry["peak_effective_rps"], peak_rate=entry["peak_rate"],
        )
        for name, entry in document["policies"].items()
        if "tried" in entry.get("tuning", {})
    }


def settings_toml(
    document: Mapping, fingerprint: Mapping[str, object], command: str, *,
    commit: str | None = None, date: str | None = None, note: str | None = None,
) -> str:
    """A tuned-settings file from a sweep's ``results.json`` that searched its families, on
    the scenario ``fingerprint`` describes."""
    families = families_of(document)
    if not families:
        raise TunedSettingsError("the sweep tuned no family (name one bare, e.g. sarathi, "
                                 "with --full or --retune)")
    simulations = sum(len(entry["loads"]) for entry in document["policies"].values()
                      if "best_of" not in entry)
    date = date or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lines = [
        "# Baseline settings tuned by a sweep (the command below), used by `python -m",
        "# sglang_ext.sim sweep` (scripts/demo.sh) instead of searching again: each family",
        "# below runs at `best`.",
        "# Only on the scenario below: any other profile, workload, arrivals, SLO, seed, drain,",
        "# token cap or initial step model, and the sweep tunes on its own scenario instead.",
        "# Re-tune with `sweep --retune`; regenerate this file with",
        "#   python -m sglang_ext.sim sweep --full --save-tuned configs/tuned_baselines.toml",
        "",
        "[provenance]",
        f"command = {_quote(command)}",
    ]
    if commit:
        lines.append(f"commit = {_quote(commit)}")
    lines += [
        f"date = {_quote(date)}",
        f"rates = [{', '.join(f'{float(r)!r}' for r in document['rates'])}]",
        f"simulations = {simulations}",
    ]
    if note:
        lines.append(f"note = {_quote(note)}")
    lines += ["", "[scenario]  # sglang_ext.sim.tuned.scenario_fingerprint"]
    for key, value in fingerprint.items():
        if key != "slo":
            lines.append(f"{key} = {_value(value)}")
    for name, targets in fingerprint["slo"].items():
        lines += ["", f"[scenario.slo.{name}]"]
        lines += [f"{key} = {_value(value)}" for key, value in targets.items()]
    for name, family in families.items():
        lines += [
            "", f"[tuned.{name}]",
            f"best = {_quote(family.best)}",
            f"edge_axes = [{', '.join(_quote(axis) for axis in family.edge_axes)}]",
            f"settings_tried = {family.settings_tried}",
            f"peak_effective_rps = {_value(family.peak_effective_rps)}",
            f"peak_rate = {_value(family.peak_rate)}",
        ]
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a TOML basic string


def _value(value: object) -> str:
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def check_document_scenario(document: Mapping, scenario_entry: Mapping) -> None:
    """Refuse a ``results.json`` whose scenario is not ``scenario_entry`` (the
    ``scenario`` block a sweep on the intended scenario writes; its workload path aside)."""
    recorded = dict(document["scenario"])
    expected = dict(scenario_entry)
    recorded["workload"] = str(recorded["workload"]).rsplit("/", 1)[-1]
    expected["workload"] = str(expected["workload"]).rsplit("/", 1)[-1]
    differing = sorted(key for key in set(recorded) | set(expected)
                       if recorded.get(key) != expected.get(key))
    if differing:
        raise TunedSettingsError(
            f"results.json's scenario differs from this one in {', '.join(differing)}"
        )


def preset_labels(settings: TunedSettings, names: Sequence[str]) -> dict[str, str]:
    """The file's setting of each bare tunable family among ``names`` it has one for."""
    return {name: settings.families[name].best for name in names
            if name in settings.families and parse_policy(name).is_tunable}

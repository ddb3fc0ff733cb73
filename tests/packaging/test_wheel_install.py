"""A real install works: the project built as a wheel, installed (not editable) into a fresh
virtual environment, runs from a directory outside the checkout with no PYTHONPATH, and
finds its bundled configs and GPU profiles inside site-packages.

``sglang_ext/data/configs`` is a symlink to the checkout's ``configs/`` (one copy in the
repository); setuptools follows it when it builds, so the wheel (and the sdist) carry the
files themselves. The tests check that they do, byte for byte, and that every
``package-data`` pattern of pyproject.toml names files that exist.

The install test is ``slow`` (about 30 s: a venv, the dependencies from the package
index, pip's cache reused); it skips only where a virtual environment with pip cannot be
created (no ``ensurepip``). Each step's time is printed, so a failure shows them.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BUNDLED_LINK = ROOT / "sglang_ext" / "data" / "configs"  # -> ../../configs
STEP_TIMEOUT_S = 300


def _package_data() -> list[tuple[str, str]]:
    """(package, pattern) for every package-data entry of pyproject.toml."""
    table = PYPROJECT["tool"]["setuptools"]["package-data"]
    return [(package, pattern) for package, patterns in table.items() for pattern in patterns]


def _shipped(package: str, pattern: str) -> list[Path]:
    return sorted(path for path in (ROOT / package.replace(".", "/")).glob(pattern)
                  if path.is_file())


def test_every_package_data_pattern_names_existing_files():
    assert _package_data()
    empty = [f"{package}: {pattern}" for package, pattern in _package_data()
             if not _shipped(package, pattern)]
    assert not empty, f"package-data patterns that match no file: {empty}"


def test_the_bundled_configs_link_resolves_and_every_config_is_shipped():
    assert BUNDLED_LINK.is_symlink() and BUNDLED_LINK.resolve() == ROOT / "configs"
    shipped = {path for package, pattern in _package_data() for path in _shipped(package, pattern)}
    configs = [path for path in (ROOT / "configs").rglob("*")
               if path.is_file() and not path.name.startswith(".")]
    assert configs
    unshipped = [str(path.relative_to(ROOT)) for path in configs
                 if BUNDLED_LINK / path.relative_to(ROOT / "configs") not in shipped]
    assert not unshipped, f"configs no package-data pattern ships: {unshipped}"


# ------------------------------------------------------------------ the real install
class Steps:
    """Runs each step as a subprocess and prints how long it took (pytest shows the
    prints when the test fails)."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    def run(self, name: str, argv: list, **kwargs) -> subprocess.CompletedProcess:
        start = time.perf_counter()
        proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                              timeout=STEP_TIMEOUT_S, **kwargs)
        self.times.append((name, time.perf_counter() - start))
        print(f"{name}: {self.times[-1][1]:.1f} s (exit {proc.returncode})")
        return proc

    def ok(self, name: str, argv: list, **kwargs) -> subprocess.CompletedProcess:
        proc = self.run(name, argv, **kwargs)
        assert proc.returncode == 0, (
            f"{name} exited {proc.returncode}: {' '.join(map(str, argv))}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}\n"
            f"--- timings\n{self.text()}"
        )
        return proc

    def text(self) -> str:
        return "\n".join(f"{name}: {seconds:.1f} s" for name, seconds in self.times)


def _source_tree(dest: Path) -> Path:
    """What a build needs, copied from the checkout (links kept as links), so the build's
    build/ and *.egg-info land outside the checkout: pyproject.toml, setup.py (the compiled
    module), the README, the packages pyproject includes (without a compiled module built in
    place), and the top-level directories their links point into."""
    dest.mkdir()
    includes = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [path for path in ROOT.iterdir() if path.is_dir()
                and any(fnmatch.fnmatch(path.name, pattern) for pattern in includes)]
    linked = {
        (link.parent / os.readlink(link)).resolve().relative_to(ROOT).parts[0]
        for package in packages for link in package.rglob("*") if link.is_symlink()
    }
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    for name in sorted({"pyproject.toml", "setup.py", PYPROJECT["project"]["readme"],
                        *(p.name for p in packages), *linked}):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)
    return dest


def _expected_data() -> dict[str, bytes]:
    """Archive name -> content of every package-data file, links followed."""
    return {
        str(Path(package.replace(".", "/")) / path.relative_to(ROOT / package.replace(".", "/"))):
            path.read_bytes()
        for package, pattern in _package_data() for path in _shipped(package, pattern)
    }


def _build_env() -> tuple[list[str], dict[str, str]]:
    """pip's build flags (the test interpreter's setuptools when it is new enough, else an
    isolated build) and an environment without the checkout on PYTHONPATH."""
    flags = []
    try:
        if int(importlib.metadata.version("setuptools").split(".")[0]) >= 77:
            importlib.metadata.version("wheel")
            flags = ["--no-build-isolation"]
    except importlib.metadata.PackageNotFoundError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return flags, env


@pytest.mark.slow
def test_a_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path):
    if importlib.util.find_spec("ensurepip") is None or importlib.util.find_spec("venv") is None:
        pytest.skip(f"{sys.executable} has no ensurepip/venv: a virtual environment with pip "
                    "cannot be created")
    steps = Steps()
    flags, env = _build_env()
    src = _source_tree(tmp_path / "src")
    dist = tmp_path / "dist"

    # the wheel carries the package data as files, identical to the checkout's
    steps.ok("build the wheel", [sys.executable, "-m", "pip", "wheel", "--no-deps", *flags,
                                 "-w", dist, f"{src}/"], env=env, cwd=tmp_path)
    (wheel,) = dist.glob("fairbatching_sglang-*.whl")
    expected = _expected_data()
    with zipfile.ZipFile(wheel) as archive:
        infos = {info.filename: info for info in archive.infolist()}
        missing = sorted(set(expected) - set(infos))
        assert not missing, f"the wheel lacks {missing}\n{steps.text()}"
        for name, content in expected.items():
            assert not stat.S_ISLNK(infos[name].external_attr >> 16), f"{name} is a link"
            assert archive.read(name) == content, f"{name} differs from the checkout's"
    # so does the sdist (a build from it, e.g. `python -m build`, sees the same files)
    sdist_dir = tmp_path / "sdist"
    steps.ok("build the sdist", [sys.executable, "-c",
                                 "import sys; from setuptools import build_meta as b; "
                                 "print(b.build_sdist(sys.argv[1]))", sdist_dir], env=env, cwd=src)
    (sdist,) = sdist_dir.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1]: m for m in archive.getmembers() if "/" in m.name}
        for name, content in expected.items():
            assert name in members and members[name].isfile(), f"the sdist lacks {name} as a file"
            assert archive.extractfile(members[name]).read() == content, f"sdist: {name} differs"

    # a fresh environment: the wheel, not editable, and its dependencies from the index
    venv = tmp_path / "venv"
    created = steps.run("create the venv", [sys.executable, "-m", "venv", venv], env=env)
    if created.returncode != 0 and "ensurepip" in created.stdout + created.stderr:
        pytest.skip(f"no virtual environment with pip: {created.stdout}{created.stderr}")
    assert created.returncode == 0, created.stderr
    python = venv / "bin" / "python"
    steps.ok("pip install the wheel", [python, "-m", "pip", "install", "--quiet",
                                       "--disable-pip-version-check", wheel], env=env,
             cwd=tmp_path)

    # everything below runs outside the checkout, with no PYTHONPATH
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    site = Path(steps.ok("site-packages", [python, "-c", "import sysconfig; "
                                           "print(sysconfig.get_paths()['purelib'])"],
                         env=env, cwd=elsewhere).stdout.strip()).resolve()
    probe = steps.ok("where the package resolves", [python, "-c", PROBE], env=env, cwd=elsewhere)
    found = json.loads(probe.stdout)
    for key in ("sglang_ext", "controlplane", "configs_dir", "profiles_dir", "slo_config"):
        path = Path(found[key])
        assert path.resolve().is_relative_to(site), f"{key} = {path}, not under {site}"
        assert not path.resolve().is_relative_to(ROOT), f"{key} = {path} is the checkout's"
    configs = Path(found["configs_dir"])
    assert not configs.is_symlink() and configs.is_dir()
    profile = configs / "profiles" / "llama3.1-8b-h100.toml"
    assert profile.is_file() and not profile.is_symlink()
    assert profile.read_bytes() == (ROOT / "configs/profiles/llama3.1-8b-h100.toml").read_bytes()
    assert set(found["profiles"]) == {p.stem for p in (ROOT / "configs/profiles").glob("*.toml")}
    assert found["plugin"] == "sglang_ext.adapter.plugin:register"

    run = steps.ok("sim run", [python, "-m", "sglang_ext.sim", "run", "--policy", "sarathi@1024",
                               "--rate", "4", "--head-seconds", "10"], env=env, cwd=elsewhere)
    table = run.stdout.split("\n\n")[0].splitlines()
    rows = [line.split()[0] for line in table[2:]]  # the rows under the header and its rule
    assert rows == ["sarathi@1024"] and "at 4 req/s:" in run.stdout, run.stdout
    (written,) = [line.split(" ", 1)[1] for line in run.stdout.splitlines()
                  if line.startswith("wrote ")]
    results = elsewhere / written
    assert results.is_relative_to(elsewhere / "out"), written
    document = json.loads(results.read_text())
    assert document["requested"] == ["sarathi@1024"] and list(document["policies"]) == [
        "sarathi@1024"]
    assert document["rates"] == [4.0]
    assert document["scenario"]["profile"] == "llama3.1-8b-h100"
    assert document["policies"]["sarathi@1024"]["loads"][0]["requests"] > 0

    # the compiled decision path is built where a C compiler is, else the reference runs
    path = steps.ok("decision path", [python, "-c", "from sglang_ext.policy import compiled; "
                                      "print(compiled.decision_path())"], env=env, cwd=elsewhere)
    compiler = shutil.which(os.environ.get("CC", "cc"))
    assert path.stdout.startswith("compiled" if compiler else "pure Python"), path.stdout
    with zipfile.ZipFile(wheel) as archive:
        built = [name for name in archive.namelist() if name.startswith("sglang_ext/policy/_compiled")
                 and name.endswith(".so")]
    assert bool(built) == bool(compiler), built

    cli = steps.ok("fairbatching-controlplane --help",
                   [venv / "bin" / "fairbatching-controlplane", "--help"], env=env, cwd=elsewhere)
    assert cli.stdout.startswith("usage: fairbatching-controlplane")
    for command in ("serve", "status", "ranks", "drain", "resume", "gateway", "keygen"):
        assert f"\n    {command} " in cli.stdout, f"--help does not list {command}\n{cli.stdout}"


#: run by the installed interpreter: where the packages and their bundled files resolve
PROBE = """
import importlib.metadata, json
import controlplane, sglang_ext, sglang_ext.bundled as bundled
from sglang_ext.sim import commands, profile
(plugin,) = [e.value for e in importlib.metadata.entry_points(group="sglang.srt.plugins")
             if e.name == "fairbatching"]
print(json.dumps({
    "sglang_ext": sglang_ext.__file__, "controlplane": controlplane.__file__,
    "configs_dir": str(bundled.CONFIGS_DIR), "profiles_dir": str(profile.PROFILES_DIR),
    "slo_config": str(commands.DEFAULT_SLO_CONFIG), "profiles": profile.available_profiles(),
    "plugin": plugin,
}))
"""

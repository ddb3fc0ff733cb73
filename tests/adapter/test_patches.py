"""patches/*.patch is applied to the installed SGLang, reverts to the wheel's own files,
and the patched modules import and expose what sglang_ext.adapter.dp_pab hooks into."""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
PATCHES = sorted((REPO / "patches").glob("*.patch"))
SITE_PACKAGES = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]).parent


def patched_files(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ (\S+)", patch.read_text(), flags=re.MULTILINE)


def wheel_sha256(relpath: str) -> str:
    record = importlib.metadata.distribution("sglang").read_text("RECORD")
    for row in csv.reader(record.splitlines()):
        if row and row[0] == relpath:
            return row[1]
    raise KeyError(f"{relpath} is not in sglang's RECORD")


def sha256_record_form(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def run_patch(patch: Path, directory: Path, *flags: str) -> subprocess.CompletedProcess:
    with patch.open("rb") as stdin:
        return subprocess.run(
            ["patch", "-p0", "-d", str(directory), "--batch", "--force", "--fuzz=0",
             "--no-backup-if-mismatch", "--reject-file=-", *flags],
            stdin=stdin, capture_output=True, text=True,
        )


def test_there_is_a_patch() -> None:
    assert PATCHES


def test_patches_sh_check_says_applied() -> None:
    result = subprocess.run(
        [str(REPO / "scripts" / "patches.sh"), "check"], capture_output=True, text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [f"applied {p.name}" for p in PATCHES]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_reverses_to_the_wheels_files_and_applies_to_them(
    patch: Path, tmp_path: Path
) -> None:
    assert run_patch(patch, SITE_PACKAGES, "--reverse", "--dry-run").returncode == 0
    for relpath in patched_files(patch):
        (tmp_path / relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(SITE_PACKAGES / relpath, tmp_path / relpath)
    reverted = run_patch(patch, tmp_path, "--reverse")
    assert reverted.returncode == 0, reverted.stdout + reverted.stderr
    for relpath in patched_files(patch):
        assert sha256_record_form(tmp_path / relpath) == wheel_sha256(relpath), relpath
    forward = run_patch(patch, tmp_path, "--dry-run")
    assert forward.returncode == 0, forward.stdout + forward.stderr


def test_patch_files_explain_themselves() -> None:
    for patch in PATCHES:
        text = patch.read_text()
        assert text.startswith("# "), patch.name
        for relpath in patched_files(patch):
            comment = f"# {relpath}:"
            assert comment in text and text.index(comment) < text.index(f"--- {relpath}")


def test_controller_has_the_pab_method_and_hook_points() -> None:
    from sglang.srt.managers import data_parallel_controller as dpc

    assert dpc.LoadBalanceMethod.from_str("pab") is dpc.LoadBalanceMethod.PAB
    init = dpc.DataParallelController.__dict__["init_pab_dispatch"]
    while hasattr(init, "__wrapped__"):  # the plugin's hooks may be applied in this process
        init = init.__wrapped__
    with pytest.raises(RuntimeError, match="fairbatching-sglang plugin"):
        init(object())


def test_load_snapshot_carries_the_pab_fields_over_the_wire() -> None:
    from sglang.srt.managers import load_snapshot as ls

    assert "pab" in ls._LOAD_AWARE_METHODS
    default = ls.LoadSnapshot()
    assert (default.fairbatching_pab_tokens, default.fairbatching_dispatch_seq) == (None, 0)
    snapshot = ls.LoadSnapshot(dp_rank=1, fairbatching_pab_tokens=-12, fairbatching_dispatch_seq=7)
    decoded = ls.snapshot_decoder.decode(ls.snapshot_encoder.encode(snapshot))
    assert (decoded.fairbatching_pab_tokens, decoded.fairbatching_dispatch_seq) == (-12, 7)
    assert decoded.to_dict(include={"core"})["fairbatching_pab_tokens"] == -12


def test_server_args_parse_load_balance_method_pab() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "dummy", "--load-balance-method", "pab"])
    assert ServerArgs.from_cli_args(args).load_balance_method == "pab"


def test_patches_sh_upgrades_an_older_applied_version_in_place(tmp_path: Path) -> None:
    """A patch edited after it was applied: ``apply`` reverts the applied version (kept
    when it was applied) and applies the new one; ``revert`` restores the wheel's files."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    for patch in PATCHES:
        for relpath in patched_files(patch):
            (tmp_path / relpath).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(SITE_PACKAGES / relpath, tmp_path / relpath)
        assert run_patch(patch, tmp_path, "--reverse").returncode == 0
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}

    def patches_sh(action: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(REPO / "scripts" / "patches.sh"), action],
                              capture_output=True, text=True, env=env, cwd=tmp_path)

    older = tmp_path / "older"
    older.mkdir()
    for patch in PATCHES:  # an "older version": the patch without its last added line
        lines = patch.read_text().splitlines(keepends=True)
        last = max(i for i, line in enumerate(lines) if line.startswith("+") and not line.startswith("+++"))
        hunk = max(i for i in range(last) if lines[i].startswith("@@"))
        old_start, old_len, new_start, new_len = map(int, re.match(
            r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", lines[hunk]).groups())
        lines[hunk] = f"@@ -{old_start},{old_len} +{new_start},{new_len - 1} @@\n"
        del lines[last]
        (older / patch.name).write_text("".join(lines))
        assert run_patch(older / patch.name, tmp_path).returncode == 0
        record = tmp_path / ".fairbatching-patches"
        record.mkdir(exist_ok=True)
        shutil.copy2(older / patch.name, record / patch.name)
    assert patches_sh("check").returncode == 1
    applied = patches_sh("apply")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert applied.stdout.splitlines() == [f"upgraded {p.name}" for p in PATCHES]
    assert patches_sh("check").returncode == 0
    for patch in PATCHES:
        for relpath in patched_files(patch):
            assert (tmp_path / relpath).read_bytes() == (SITE_PACKAGES / relpath).read_bytes()
    assert patches_sh("revert").returncode == 0
    for patch in PATCHES:
        for relpath in patched_files(patch):
            assert sha256_record_form(tmp_path / relpath) == wheel_sha256(relpath), relpath


def test_load_snapshot_carries_the_admission_budgets() -> None:
    from sglang.srt.managers import load_snapshot as ls

    assert ls.LoadSnapshot().fairbatching_admission is None
    snapshot = ls.LoadSnapshot(dp_rank=0, fairbatching_admission={"interactive": -40, "standard": 900})
    decoded = ls.snapshot_decoder.decode(ls.snapshot_encoder.encode(snapshot))
    assert decoded.fairbatching_admission == {"interactive": -40, "standard": 900}

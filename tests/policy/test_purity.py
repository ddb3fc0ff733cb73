"""The policy core must stay importable without SGLang or PyTorch (the simulator, the
control plane and the SDK run where neither is installed)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POLICY_DIR = REPO / "sglang_ext" / "policy"
MODULES = [
    "sglang_ext",
    "sglang_ext.policy.policies",
    "sglang_ext.policy.batch_former",
    "sglang_ext.policy.pab",
    "sglang_ext.policy.gc",
    "sglang_ext.policy.step_model",
    "sglang_ext.policy.slo",
]
HEAVY = ("sglang", "torch")
HEAVY_LINE = re.compile(r"^\s*(?:import|from)\s+(?:sglang|torch)\b(?!_)", re.MULTILINE)


def test_importing_the_policy_core_loads_neither_sglang_nor_torch() -> None:
    code = (
        "import json, sys\n"
        f"import {', '.join(MODULES)}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def heavy_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] in HEAVY]
    return found


POLICY_FILES = sorted(POLICY_DIR.glob("*.py"))


def test_policy_directory_is_scanned() -> None:
    assert {p.name for p in POLICY_FILES} >= {
        "batch_former.py", "gc.py", "pab.py", "policies.py", "name_registry.py",
        "slo.py", "step_model.py", "view.py",
    }


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: p.name)
def test_no_heavy_import_statements(path: Path) -> None:
    # AST: catches imports anywhere, including inside functions
    assert heavy_imports(path) == []
    # text: the same statements by pattern (sglang_ext itself is of course allowed)
    assert HEAVY_LINE.findall(path.read_text()) == []


def test_the_scanner_detects_heavy_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os\ndef f():\n    import torch.cuda\n    from sglang.srt import x\n")
    assert heavy_imports(probe) == ["probe.py:3: torch.cuda", "probe.py:4: sglang.srt"]
    assert len(HEAVY_LINE.findall(probe.read_text())) == 2
    assert HEAVY_LINE.findall("from sglang_ext.policy import x\nimport sglang_ext\n") == []

"""The import rules docs/layout.md states, held against the code (read with ``ast``)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.import_graph import read_graph

REPO = Path(__file__).resolve().parents[1]
GRAPH = read_graph(REPO)


def arrows_from(prefix: str) -> set[tuple[str, str]]:
    return {(a, b) for a, b in GRAPH.arrows if a == prefix or a.startswith(prefix + ".")}


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_no_import_circle() -> None:
    assert GRAPH.circles() == []


def test_the_policy_core_imports_only_itself() -> None:
    outside = {(a, b) for a, b in arrows_from("sglang_ext.policy")
               if not under(b, "sglang_ext.policy")}
    assert outside == set()


def test_the_control_plane_imports_nothing_of_sglang_ext() -> None:
    assert {(a, b) for a, b in arrows_from("controlplane") if under(b, "sglang_ext")} == set()


def test_the_simulator_does_not_import_the_adapter() -> None:
    assert {(a, b) for a, b in arrows_from("sglang_ext.sim")
            if under(b, "sglang_ext.adapter")} == set()


def test_no_product_module_imports_the_tools() -> None:
    product = arrows_from("sglang_ext") | arrows_from("controlplane")
    assert {(a, b) for a, b in product if under(b, "benchmarks")} == set()


def test_the_graph_reads_the_whole_tree() -> None:
    assert {"sglang_ext.policy.slo", "controlplane.core", "benchmarks.import_graph"} <= set(
        GRAPH.modules)
    assert ("sglang_ext.sim.engine", "sglang_ext.policy.policies") in GRAPH.arrows

"""The project's import structure: files as boxes, folders as clusters, imports as arrows.

Reads the source with :mod:`ast` (nothing is imported or run) and writes a Graphviz DOT
file; with Graphviz's ``dot`` on PATH it also renders it (``--svg``). It prints what a
reviewer checks after moving files: how many files and arrows, the import circles, and the
arrows between top-level rooms::

    python -m benchmarks.import_graph --dot docs/img/imports.dot --svg docs/img/imports.svg
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOMS = ("sglang_ext", "controlplane", "benchmarks")
ROOM_COLOURS = {"sglang_ext": "#dbe9f6", "controlplane": "#fde2c8", "benchmarks": "#e2f0d9",
                "scripts": "#f3d9ea"}


@dataclass(frozen=True)
class ImportGraph:
    modules: Mapping[str, Path]  # dotted name -> file
    arrows: frozenset[tuple[str, str]]  # (importer, imported), both dotted names

    def circles(self) -> list[list[str]]:
        """Strongly connected sets of more than one module (Tarjan), each sorted."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        out: dict[str, list[str]] = {m: [] for m in self.modules}
        for a, b in self.arrows:
            out[a].append(b)
        found: list[list[str]] = []

        def visit(node: str) -> None:
            index[node] = low[node] = len(index)
            stack.append(node)
            on_stack.add(node)
            for nxt in out[node]:
                if nxt not in index:
                    visit(nxt)
                    low[node] = min(low[node], low[nxt])
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))

        sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
        for module in sorted(self.modules):
            if module not in index:
                visit(module)
        return sorted(found)

    def room_arrows(self, depth: int = 2) -> Counter[tuple[str, str]]:
        """Arrows between folders ``depth`` levels deep (``sglang_ext.sim``), none to itself."""
        counts: Counter[tuple[str, str]] = Counter()
        for a, b in self.arrows:
            ra, rb = _room(a, self.modules, depth), _room(b, self.modules, depth)
            if ra != rb:
                counts[(ra, rb)] += 1
        return counts


def _room(module: str, modules: Mapping[str, Path], depth: int) -> str:
    parts = module.split(".")
    if modules[module].name != "__init__.py":
        parts = parts[:-1]
    return ".".join(parts[:depth]) or module


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_graph(root: Path, rooms: Iterable[str] = ROOMS) -> ImportGraph:
    modules = {
        module_name(root, path): path
        for room in rooms if (root / room).is_dir()
        for path in sorted((root / room).rglob("*.py"))
    }
    arrows = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for target in _imported(tree, package, modules):
            if target != name:
                arrows.add((name, target))
    return ImportGraph(modules, frozenset(arrows))


def _imported(tree: ast.AST, package: str, modules: Mapping[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules, package) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            elif base:
                base = _known(base, modules, package) or base
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else _known(base, modules))
    found.discard(None)
    return found


def _known(dotted: str, modules: Mapping[str, Path], package: str = "") -> str | None:
    """The longest prefix of ``dotted`` that is a module of the project, else None; a bare
    name is tried beside the importer too (a script run with its own folder on sys.path)."""
    first = dotted.split(".")[0]
    if first not in {module.split(".")[0] for module in modules}:
        if not (package and f"{package}.{first}" in modules):
            return None
        dotted = f"{package}.{dotted}"
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def to_dot(graph: ImportGraph) -> str:
    lines = [
        "digraph imports {",
        '  graph [rankdir=LR, compound=true, fontname="Helvetica", fontsize=11, ranksep=1.2];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=9, height=0.2];',
        '  edge [color="#00000040", arrowsize=0.5];',
    ]
    tree: dict = {}
    for module in sorted(graph.modules):
        folder = _room(module, graph.modules, 99).split(".")
        node = tree
        for part in folder:
            node = node.setdefault(part, {})
        node.setdefault("", []).append(module)
    counter = iter(range(10**6))

    def emit(node: dict, prefix: list[str], indent: str) -> None:
        for key, child in sorted((k, v) for k, v in node.items() if k):
            path = [*prefix, key]
            colour = ROOM_COLOURS.get(path[0], "#eeeeee")
            lines.append(f"{indent}subgraph cluster_{next(counter)} {{")
            lines.append(f'{indent}  label="{"/".join(path)}/"; style="rounded,filled"; '
                         f'fillcolor="{colour}"; color="#888888";')
            for module in child.get("", []):
                path_name = graph.modules[module].name
                lines.append(f'{indent}  "{module}" [label="{path_name}", fillcolor="white"];')
            emit(child, path, indent + "  ")
            lines.append(f"{indent}}}")

    emit(tree, [], "  ")
    for a, b in sorted(graph.arrows):
        lines.append(f'  "{a}" -> "{b}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def summary(graph: ImportGraph) -> str:
    out = [f"{len(graph.modules)} files, {len(graph.arrows)} import arrows"]
    circles = graph.circles()
    out.append(f"import circles: {len(circles)}")
    out += [f"  circle: {' <-> '.join(circle)}" for circle in circles]
    out.append("arrows between folders (two levels deep):")
    out += [f"  {a} -> {b}: {n}" for (a, b), n in sorted(graph.room_arrows().items())]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.import_graph",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout (default: .)")
    parser.add_argument("--dot", type=Path, help="write the DOT file here")
    parser.add_argument("--svg", type=Path, help="render the picture here (needs Graphviz's dot)")
    parser.add_argument("--rooms", nargs="+", default=list(ROOMS),
                        help=f"top-level folders to read (default: {' '.join(ROOMS)})")
    args = parser.parse_args(argv)
    graph = read_graph(args.root, args.rooms)
    print(summary(graph))
    dot_text = to_dot(graph)
    if args.dot:
        args.dot.write_text(dot_text)
    if args.svg:
        if shutil.which("dot") is None:
            print("error: --svg needs Graphviz's dot on PATH", file=sys.stderr)
            return 2
        subprocess.run(["dot", "-Tsvg", "-o", str(args.svg)], input=dot_text, text=True,
                       check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

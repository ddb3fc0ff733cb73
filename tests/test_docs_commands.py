"""The README and docs/*.md as a newcomer meets them: their cheap commands run as written,
their relative links resolve, and the README keeps the two set-up commands CI depends on.

The rule for a cheap command: a fenced block whose opening line is exactly ```bash and
whose previous line is exactly `<!-- cheap -->`, in README.md, docs/*.md or docs/results/*.md (the pages, not
the generated docs/report/ and docs/bench/). Mark a block cheap only when every line runs
in seconds on a CPU, needs no server, GPU or network, and writes only to new paths
relative to the working directory (e.g. the simulator's default `out/run-<time>/`).

A block's commands are its lines, a trailing backslash joining a line to the next (blank
and comment lines are skipped). Each command runs as written, as its own `bash -euo
pipefail` script, in order, in one scratch directory per block that mirrors the
repository root: one symlink per top-level entry except `.git` and `out`, so relative
paths such as `configs/` and `tests/fixtures/` resolve and what a command writes lands in
the scratch directory (shell state, `cd` or variables, does not carry from one command to
the next). `python` and the console scripts are the test interpreter's (its bin directory
first on PATH), importing this checkout (PYTHONPATH = the repository root). A command must
exit 0, and what it produced must be what it says: each simple command (a command split
at `&&` and `;`) is looked up in CHECKERS by its program and subcommand (`python -m
sglang_ext.sim run`; a `--help` anywhere adds ` --help`), whose checker reads its output
and the files it wrote (`sim run`: the table and results.json name every policy given and
the rate). A cheap command with no checker fails the test, before anything runs: a newly
documented command needs an entry. A block that writes into the checkout fails the test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHEAP_MARK = "<!-- cheap -->"
TIMEOUT_S = 120

SETUP_BLOCK = """```bash
scripts/demo.sh    # the main job: the shipped policy against the three strongest baselines, one SLO class and three
scripts/test.sh    # the whole test suite (what CI runs; `scripts/test.sh -m "not slow and not e2e"` for the fast part)
```"""


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "docs" / "results").glob("*.md"))]


def cheap_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number of the fence, the block's text) for every cheap block of a page."""
    lines = path.read_text().split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i] == "```bash" and i > 0 and lines[i - 1].strip() == CHEAP_MARK:
            end = lines.index("```", i + 1)  # ValueError: an unclosed block fails loudly
            blocks.append((i + 1, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


ALL_BLOCKS = [
    pytest.param(path, line, text, id=f"{path.relative_to(ROOT)}:{line}")
    for path in doc_pages()
    for line, text in cheap_blocks(path)
]


def test_cheap_blocks_are_found():
    assert any(p.values[0].name == "README.md" for p in ALL_BLOCKS)
    assert len(ALL_BLOCKS) >= 4, [p.id for p in ALL_BLOCKS]


def _checkout_changes() -> set[str] | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT, capture_output=True, text=True,
    )
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


# ------------------------------------------------------------------ commands and checkers
def block_commands(text: str) -> list[str]:
    """A block's commands: its lines, a trailing backslash joining a line to the next;
    blank and comment-only lines dropped."""
    commands, pending = [], ""
    for line in text.split("\n"):
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            commands.append(command)
    assert not pending, f"a block ends inside a continued line: {pending!r}"
    return commands


#: programs a cheap command may start with, and whether their second word is a subcommand
PROGRAMS = {
    "python -m sglang_ext.sim.rank": False,
    "python -m sglang_ext.sim": True,
    "fairbatching-controlplane": True,
    "mkdir": False,
    "cp": False,
}
SEPARATORS = {"&&", ";"}


def simple_commands(command: str) -> list[list[str]]:
    """The words of each simple command of ``command`` (split at ``&&`` and ``;``, comments
    dropped). Pipes, redirections, subshells and background jobs are refused: their output
    is not one command's to check."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    simple: list[list[str]] = [[]]
    for token in lexer:
        if token in SEPARATORS:
            simple.append([])
        elif token and set(token) <= set(lexer.punctuation_chars):
            raise ValueError(f"{command!r}: {token!r} is not supported in a checked command")
        else:
            simple[-1].append(token)
    return [words for words in simple if words]


def command_key(words: list[str]) -> tuple[str, str, list[str]]:
    """(the CHECKERS key, the program, the words after it) of one simple command."""
    for program, has_subcommands in PROGRAMS.items():
        head = program.split()
        if words[:len(head)] == head:
            rest = words[len(head):]
            key = [program]
            if has_subcommands and rest and not rest[0].startswith("-"):
                key.append(rest[0])
            if "--help" in rest or "-h" in rest:
                key.append("--help")
            return " ".join(key), program, rest
    return words[0], words[0], words[1:]


@dataclass
class Ran:
    """One simple command of a block, after its command ran."""

    program: str
    args: list[str]  # the words after the program
    stdout: str  # the whole command's (a command joined by && shares it)
    work: Path  # the scratch directory it ran in

    def fail(self, message: str) -> str:
        return f"{self.program} {shlex.join(self.args)}: {message}\n--- stdout\n{self.stdout[-3000:]}"


def _parser(program: str):
    from controlplane.cli import build_parser as controlplane_parser
    from sglang_ext.sim.commands import build_parser as sim_parser
    from sglang_ext.sim.rank import build_parser as rank_parser

    return {
        "python -m sglang_ext.sim": sim_parser,
        "python -m sglang_ext.sim.rank": rank_parser,
        "fairbatching-controlplane": controlplane_parser,
    }[program]()


def _subparsers(parser) -> dict:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_help(ran: Ran) -> None:
    """The usage of the (sub)command asked for, naming every one of its options and
    subcommands."""
    parser = _parser(ran.program)
    if ran.args[0] in _subparsers(parser):
        parser = _subparsers(parser)[ran.args[0]]
    assert ran.stdout.startswith(f"usage: {parser.prog}"), ran.fail("no usage line")
    names = [option for action in parser._actions for option in action.option_strings
             if option.startswith("--")]
    names += list(_subparsers(parser))
    missing = [name for name in names if name not in ran.stdout]
    assert not missing, ran.fail(f"the help does not name {missing}")


def _table_rows(stdout: str) -> tuple[str, list[str]]:
    """The simulator's table: (its header, the policy column row by row)."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("policy ")), None)
    assert start is not None, "no table"
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(line.split()[0])
    return lines[start], rows


def check_sim_run(ran: Ran) -> None:
    """The table has one row per policy given, in order, at the rate given; the results.json
    it says it wrote holds the same policies at that rate (and the profile and SLO classes
    of --profile and --class-mix)."""
    from sglang_ext.sim.commands import _with_admission
    from sglang_ext.sim.policy_spec import parse_policy

    args = _parser(ran.program).parse_args(ran.args)
    expected = list(dict.fromkeys(
        parse_policy(text).label for text in _with_admission(args.policies or ["fb"], args.admission)
    ))
    header, rows = _table_rows(ran.stdout)
    assert rows == expected, ran.fail(f"table rows {rows}, policies given {expected}")
    written = re.findall(r"^wrote (\S+)$", ran.stdout, re.M)
    assert len(written) == 1, ran.fail("no single `wrote PATH` line")
    document = json.loads((ran.work / written[0]).read_text())
    rate = args.rate or document["rates"][0]
    assert f"at {rate:g} req/s:" in header, ran.fail(f"the table is not at {rate:g} req/s")
    assert document["rates"] == [rate] and document["cdf_rate"] == rate, ran.fail(
        f"results.json rates {document['rates']}, asked {rate:g}")
    assert document["requested"] == expected, ran.fail(
        f"results.json requested {document['requested']}, given {expected}")
    assert list(document["policies"]) == expected, ran.fail(
        f"results.json policies {list(document['policies'])}, given {expected}")
    for name in expected:
        loads = document["policies"][name]["loads"]
        assert [load["rate"] for load in loads] == [rate], ran.fail(f"{name}: loads at {loads}")
        assert loads[0]["requests"] > 0, ran.fail(f"{name}: no requests")
    if not Path(args.profile).suffix:
        assert document["scenario"]["profile"] == args.profile, ran.fail("another profile")
    if args.class_mix is not None:
        for slo_class, _ in args.class_mix.fractions:
            assert slo_class in header, ran.fail(f"the table has no column for {slo_class}")
            for name in expected:
                by_class = document["policies"][name]["loads"][0]["by_slo_class"]
                assert by_class[slo_class]["requests"] > 0, ran.fail(f"{name}: no {slo_class}")


def check_predictor_check(ran: Ran) -> None:
    """Both predictors' held-out and online errors on the grid given, and the best."""
    args = _parser(ran.program).parse_args(ran.args)
    assert ran.stdout.startswith(f"grid: {args.grid} ("), ran.fail("does not name the grid")
    assert f"held out (seed {args.seed})" in ran.stdout, ran.fail("no held-out section")
    assert "\nonline:" in ran.stdout, ran.fail("no online section")
    for predictor in ("linear", "knee"):
        assert re.search(rf"^{predictor}\s+all\s", ran.stdout, re.M), ran.fail(predictor)
    assert re.search(r"^best: (linear|knee) MAPE \d", ran.stdout, re.M), ran.fail("no best")
    if args.json:
        assert json.loads((ran.work / args.json).read_text()), ran.fail("empty --json")


def check_keygen(ran: Ran) -> None:
    """DIR/NAME.key (public only) and DIR/NAME.key_secret (the pair, owner-only), named."""
    _, directory, name = ran.args
    public = ran.work / directory / f"{name}.key"
    secret = ran.work / directory / f"{name}.key_secret"
    for path in (public, secret):
        assert path.is_file(), ran.fail(f"no {path.name}")
        assert str(path.relative_to(ran.work)) in ran.stdout, ran.fail(f"{path.name} not named")
    assert "public-key" in public.read_text() and "secret-key" not in public.read_text()
    assert "secret-key" in secret.read_text()
    assert stat.S_IMODE(secret.stat().st_mode) & 0o077 == 0, ran.fail("secret readable by others")


def check_mkdir(ran: Ran) -> None:
    for name in (arg for arg in ran.args if not arg.startswith("-")):
        assert (ran.work / name).is_dir(), ran.fail(f"no directory {name}")


def check_cp(ran: Ran) -> None:
    *sources, target = (arg for arg in ran.args if not arg.startswith("-"))
    for source in sources:
        copy = ran.work / target
        if copy.is_dir():
            copy = copy / Path(source).name
        assert copy.is_file(), ran.fail(f"no copy of {source}")
        assert copy.read_bytes() == (ran.work / source).read_bytes(), ran.fail("a different copy")


#: what each documented cheap command must have produced, by program and subcommand
CHECKERS: dict[str, Callable[[Ran], None]] = {
    "python -m sglang_ext.sim --help": check_help,
    "python -m sglang_ext.sim run": check_sim_run,
    "python -m sglang_ext.sim predictor-check": check_predictor_check,
    "python -m sglang_ext.sim.rank --help": check_help,
    "fairbatching-controlplane --help": check_help,
    "fairbatching-controlplane gateway --help": check_help,
    "fairbatching-controlplane keygen": check_keygen,
    "mkdir": check_mkdir,
    "cp": check_cp,
}


def _unchecked(text: str) -> list[str]:
    keys = [command_key(words)[0] for command in block_commands(text)
            for words in simple_commands(command)]
    return [key for key in keys if key not in CHECKERS]


@pytest.mark.parametrize(("path", "line", "text"), ALL_BLOCKS)
def test_every_cheap_command_has_a_checker(path: Path, line: int, text: str):
    unchecked = _unchecked(text)
    assert not unchecked, (
        f"{path.relative_to(ROOT)}:{line}: no checker in {Path(__file__).name}'s CHECKERS "
        f"for {unchecked}: add one that checks what the command produced"
    )


def test_the_command_parser():
    text = "a \\\n  --b c   # note\n\n# only a comment\nd 'e f' && g h; i\n"
    assert block_commands(text) == ["a    --b c   # note", "d 'e f' && g h; i"]
    assert simple_commands("d 'e f' && g h; i # x") == [["d", "e f"], ["g", "h"], ["i"]]
    for unsupported in ("a | b", "a > b", "a &", "(a)", "a || b"):
        with pytest.raises(ValueError):
            simple_commands(unsupported)
    assert command_key(["python", "-m", "sglang_ext.sim", "run", "--rate", "4"]) == (
        "python -m sglang_ext.sim run", "python -m sglang_ext.sim", ["run", "--rate", "4"])
    assert command_key(["fairbatching-controlplane", "gateway", "--help"])[0] == (
        "fairbatching-controlplane gateway --help")
    assert command_key(["python", "-m", "sglang_ext.sim.rank", "--help"])[0] == (
        "python -m sglang_ext.sim.rank --help")
    assert command_key(["mkdir", "authorized"])[0] == "mkdir"


def _sim_output(work: Path, policies: list[str], rate: float) -> str:
    """What `sim run` prints, and the results.json it writes, for ``policies`` at ``rate``."""
    document = {
        "rates": [rate], "cdf_rate": rate, "requested": policies,
        "scenario": {"profile": "llama3.1-8b-h100"},
        "policies": {name: {"loads": [{"rate": rate, "requests": 9}]} for name in policies},
    }
    (work / "out" / "run-1").mkdir(parents=True)
    (work / "out" / "run-1" / "results.json").write_text(json.dumps(document))
    rows = "".join(f"{name:<24}>=12.00  |  1.000\n" for name in policies)
    return (f"policy{'':<18}peak eff RPS  |  at {rate:g} req/s:  attain\n{'-' * 40}\n{rows}"
            "\nwrote out/run-1/results.json\n")


@pytest.mark.parametrize("produced, rate, fragment", [
    (["fb-anchor-margin", "sarathi@1024"], 12.0, None),
    (["sarathi@1024"], 12.0, "table rows ['sarathi@1024']"),  # only the last --policy ran
    (["sarathi@1024", "fb-anchor-margin"], 12.0, "table rows"),
    (["fb-anchor-margin", "sarathi@1024"], 8.0, "not at 12 req/s"),
])
def test_the_run_checker_compares_the_output_with_the_command(produced, rate, fragment, tmp_path):
    command = ["run", "--policy", "fb-anchor-margin", "--policy", "sarathi@1024", "--rate", "12"]
    ran = Ran("python -m sglang_ext.sim", command, _sim_output(tmp_path, produced, rate), tmp_path)
    if fragment is None:
        check_sim_run(ran)
    else:
        with pytest.raises(AssertionError, match=re.escape(fragment)):
            check_sim_run(ran)


def test_the_help_checker_wants_every_subcommand_and_option(tmp_path):
    usage = "usage: python -m sglang_ext.sim [-h] {run,sweep,cluster,calibrate,predictor-check}\n"
    with pytest.raises(AssertionError, match="fit-grid"):
        check_help(Ran("python -m sglang_ext.sim", ["--help"], usage, tmp_path))
    with pytest.raises(AssertionError, match="no usage line"):
        check_help(Ran("fairbatching-controlplane", ["gateway", "--help"], "serve\n", tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize(("path", "line", "text"), ALL_BLOCKS)
def test_cheap_block_runs_as_written(path: Path, line: int, text: str, tmp_path: Path):
    where = f"{path.relative_to(ROOT)}:{line}"
    assert not _unchecked(text), f"{where}: commands with no checker: {_unchecked(text)}"
    work = tmp_path / "root"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "out"):
            (work / entry.name).symlink_to(entry)
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    before = _checkout_changes()
    for command in block_commands(text):
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )
        assert proc.returncode == 0, (
            f"{where} exited {proc.returncode}\n--- command\n{command}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )
        for words in simple_commands(command):
            key, program, args = command_key(words)
            CHECKERS[key](Ran(program, args, proc.stdout, work))
    after = _checkout_changes()
    if before is not None and after is not None:
        assert after == before, f"the block changed the checkout: {sorted(after ^ before)}"


# [label](target) and ![alt](target), outside fenced blocks; a code span in a label is fine.
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto:, or an anchor on the same page
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("path", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    links = relative_links(path)
    missing = [t for t in links if not (path.parent / t).exists()]
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files: {missing}"


def test_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_results_index_links_every_results_page():
    linked = {(ROOT / "docs" / t).resolve() for t in relative_links(ROOT / "docs" / "results.md")}
    unlinked = [p.name for p in sorted((ROOT / "docs" / "results").glob("*.md"))
                if p.resolve() not in linked]
    assert not unlinked, f"results pages docs/results.md does not link: {unlinked}"


def test_readme_keeps_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert "## Set-up: two commands" in text
    assert SETUP_BLOCK in text

"""No single-valued option of the project's command lines silently keeps its last value:
given twice, it is a usage error (exit 2) naming the option (controlplane.cli_args); the
options meant to be repeated (``sim run --policy``, ``sim sweep --policy``) append."""

from __future__ import annotations

import argparse

import pytest

from controlplane import cli as controlplane_cli
from controlplane.cli_args import StoreOnce
from sglang_ext.sim import commands as sim_cli
from sglang_ext.sim import rank as sim_rank

PARSERS = {
    "fairbatching-controlplane": controlplane_cli.build_parser,
    "python -m sglang_ext.sim": sim_cli.build_parser,
    "python -m sglang_ext.sim.rank": sim_rank.build_parser,
}


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """(command, action) for every optional argument of a parser and its subcommands."""
    found = []
    todo = [parser]
    while todo:
        current = todo.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(dict.fromkeys(action.choices.values()))
            elif action.option_strings:
                found.append((current.prog, action))
    return found


@pytest.mark.parametrize("program", PARSERS)
def test_every_single_valued_option_refuses_a_repeat(program):
    options = _options(PARSERS[program]())
    loose = [f"{prog} {action.option_strings[-1]}" for prog, action in options
             if isinstance(action, argparse._StoreAction) and not isinstance(action, StoreOnce)]
    assert not loose, f"single-valued options that would keep their last value: {loose}"
    assert any(isinstance(action, StoreOnce) for _, action in options)


def test_the_repeatable_options_append():
    options = {(prog, action.option_strings[-1]): action
               for prog, action in _options(sim_cli.build_parser())}
    for command in ("run", "sweep"):
        assert isinstance(options[(f"python -m sglang_ext.sim {command}", "--policy")],
                          argparse._AppendAction)
    args = sim_cli.build_parser().parse_args(["run", "--policy", "fb", "--policy", "sarathi@512"])
    assert args.policies == ["fb", "sarathi@512"]


def test_a_parser_parses_more_than_once_and_flags_may_repeat():
    parser = sim_cli.build_parser()
    for _ in range(2):
        args = parser.parse_args(["run", "--rate", "4", "--seed", "3"])
        assert (args.rate, args.seed) == (4.0, 3)
    parser = controlplane_cli.build_parser()
    assert parser.parse_args(["status", "--json", "--json"]).json is True


def _usage_error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, option, hint", [
    (["gateway", "--listen", "127.0.0.1:8000", "--listen", "127.0.0.1:8001"], "--listen",
     "start one per address"),
    (["ranks", "--address", "tcp://127.0.0.1:1", "--address", "tcp://127.0.0.1:2"],
     "--address", ""),
    (["drain", "r0", "--wait-timeout", "1", "--wait-timeout", "2"], "--wait-timeout", ""),
    (["serve", "--config", "a.toml", "--config=b.toml"], "--config", ""),
])
def test_controlplane_cli_refuses_a_repeated_option(argv, option, hint, capsys):
    last = _usage_error(controlplane_cli.main, argv, capsys)
    assert f"argument {option}: given more than once; it takes one value" in last
    assert hint in last


@pytest.mark.parametrize("argv, option, hint", [
    (["--rank", "a", "--rank", "b"], "--rank", "--ranks N hosts N ranks"),
    (["--policy", "fb", "--policy", "sarathi@512"], "--policy", "one agent per policy"),
    (["--ranks", "2", "--ranks", "3"], "--ranks", ""),
])
def test_sim_rank_refuses_a_repeated_option(argv, option, hint, capsys):
    last = _usage_error(sim_rank.main, argv, capsys)
    assert f"argument {option}: given more than once; it takes one value" in last
    assert hint in last

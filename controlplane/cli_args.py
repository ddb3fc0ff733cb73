"""Command-line options shared by the project's CLIs: value types that refuse what is not a
positive number with one line (:func:`positive_float`, :func:`positive_int`,
:func:`non_negative_float`), the rank agent's coalescing window (:func:`coalesce_ms`, also
read from the SGLang server's environment), and single-valued options that refuse a repeat.

A single-valued command-line option given twice is an error, not a silent override.

argparse's default ``store`` action keeps the last value of a repeated option, so
``run --rate 4 --rate 8`` would run one load and say nothing. :func:`refuse_repeats`
turns every single-valued option of a parser (and of its subcommands) into one that
refuses a second occurrence with a usage error (exit status 2) naming the option and,
where the parser's author gave one, how to do what the user wanted instead. Options meant
to be repeated use ``action="append"`` and are left alone, as are flags
(``store_true``) and positional arguments.

Used by ``fairbatching-controlplane``, ``python -m sglang_ext.sim`` and
``python -m sglang_ext.sim.rank``; :func:`parse_coalesce_ms` also by the SGLang ingress
(``sglang_ext.adapter.controlplane_agent``), so both refuse the same values.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float, "a number")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text, float, "a number")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _number(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_int(text: str, maximum: int | None = None) -> int:
    """An integer >= 1 (and <= ``maximum``, if given)."""
    value = _number(text, int, "an integer")
    if value < 1 or (maximum is not None and value > maximum):
        bound = ">= 1" if maximum is None else f"from 1 to {maximum}"
        raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
    return value


#: The longest an operator may let a rank agent hold output to share a message
#: (``--coalesce-ms``, ``FAIRBATCHING_CONTROLPLANE_COALESCE_MS``). Every streamed token may
#: wait that long, so a longer window would eat a 50 ms TPOT SLO on its own.
MAX_COALESCE_MS = 50.0


def parse_coalesce_ms(text: str) -> float:
    """The rank agent's coalescing window in milliseconds: a number from 0 to
    :data:`MAX_COALESCE_MS`; ValueError with one line stating the bound otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_COALESCE_MS:  # NaN fails too
        raise ValueError(
            f"expected milliseconds from 0 to {MAX_COALESCE_MS:g}, got {text!r} (every streamed "
            f"token may wait that long; above {MAX_COALESCE_MS:g} ms the wait alone would eat a "
            f"{MAX_COALESCE_MS:g} ms TPOT SLO)"
        )
    return value


def coalesce_ms(text: str) -> float:
    """``--coalesce-ms``: :func:`parse_coalesce_ms` as an argparse type."""
    try:
        return parse_coalesce_ms(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


#: the namespace attribute recording which options this parse has seen
_GIVEN = "_single_options_given"


class StoreOnce(argparse._StoreAction):
    """``store``, refusing the option's second occurrence."""

    hint: str = ""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault(_GIVEN, set())
        if self.dest in given:
            hint = f" ({self.hint})" if self.hint else ""
            raise argparse.ArgumentError(
                self, f"given more than once; it takes one value{hint}"
            )
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


def refuse_repeats(
    parser: argparse.ArgumentParser, hints: Mapping[str, str] | None = None
) -> None:
    """Make every single-valued option of ``parser`` and its subcommands refuse a repeat.

    ``hints`` maps an option string (``"--rate"``) to what to do instead, shown in the
    error of every (sub)command's option of that name."""
    hints = hints or {}
    seen: set[int] = set()
    todo = [parser]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue  # an alias of a subcommand already done
        seen.add(id(current))
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
            elif type(action) is argparse._StoreAction and action.option_strings:
                action.__class__ = StoreOnce
                hint = next((hints[s] for s in action.option_strings if s in hints), "")
                if hint:
                    action.hint = hint


"""The router comparison's workloads (pure): the Azure sample at Poisson times, the
shared-prefix workload, and the same prefixes in bursts with three SLO classes, as requests
and as prompt text of single-token words."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.server.emulated import MAX_PROMPT_TOKENS, TINY_MODEL_CONTEXT

CONTEXT_MARGIN = 64  # output tokens cut so that prompt + output stay this far below the context

PREFIXES = 24
PREFIX_TOKENS = 4096
SUFFIX_TOKENS = (64, 192)  # uniform, inclusive
PREFIX_OUTPUT_TOKENS = (32, 128)

BURST_CV = 4.0  # the gamma gaps' coefficient of variation (Poisson: 1)
CLASS_MIX = (("interactive", 0.2), ("standard", 0.5), ("relaxed", 0.3))  # configs/slo.toml's classes

WORKLOADS = ("azure", "prefix", "bursty")
DEFAULT_RATES = {"azure": (6.0, 9.0, 12.0), "prefix": (8.0, 13.0, 18.0), "bursty": (8.0, 13.0, 18.0)}
QUICK_RATES = {"azure": (9.0,), "prefix": (13.0,), "bursty": (13.0,)}
SEED = 0  # the default arrival seed (``--seeds``), and that of a point saved without one


@dataclass(frozen=True)
class Request:
    index: int
    at_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_id: int | None = None  # shared-prefix group (prefix and bursty workloads)
    prefix_tokens: int = 0
    slo_class: str | None = None  # configs/slo.toml's class (bursty); None: the default, standard


def poisson_times(rate: float, n: int, seed: int) -> list[float]:
    """``n`` Poisson arrival times at ``rate`` req/s, the first at 0 (seeded)."""
    if rate <= 0 or n < 0:
        raise ValueError("rate must be > 0 and n >= 0")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def gamma_times(rate: float, cv: float, n: int, seed: int) -> list[float]:
    """``n`` arrival times with gamma gaps of mean ``1/rate`` and coefficient of variation
    ``cv`` (bursts: most gaps tiny, a few long), the first at 0 (seeded)."""
    if rate <= 0 or cv <= 0 or n < 0:
        raise ValueError("rate and cv must be > 0 and n >= 0")
    rng = random.Random(f"gamma-{seed}")
    shape = 1.0 / cv**2
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.gammavariate(shape, 1.0 / (rate * shape))
    return times


def point_seed(point: dict) -> int:
    """The arrival seed a saved point ran at (:data:`SEED` for a point saved without one)."""
    return point.get("seed", SEED)


def request_count(rate: float, seconds: float) -> int:
    return max(1, round(rate * seconds))


def azure_requests(rate: float, seconds: float, seed: int, lengths: Sequence[tuple[int, int]],
                   max_prompt: int = MAX_PROMPT_TOKENS,
                   max_context: int = TINY_MODEL_CONTEXT) -> list[Request]:
    """The first ``rate x seconds`` (prompt, output) pairs of ``lengths`` (trace order) at
    Poisson times; prompts capped at ``max_prompt``, outputs so that both fit the context."""
    n = request_count(rate, seconds)
    if n > len(lengths):
        raise ValueError(f"{n} requests asked, the trace has {len(lengths)}")
    requests = []
    for index, (at, (prompt, output)) in enumerate(zip(poisson_times(rate, n, seed), lengths)):
        prompt = max(1, min(prompt, max_prompt))
        output = max(1, min(output, max_context - prompt - CONTEXT_MARGIN))
        requests.append(Request(index, at, prompt, output))
    return requests


def prefix_requests(rate: float, seconds: float, seed: int, prefixes: int = PREFIXES,
                    prefix_tokens: int = PREFIX_TOKENS, suffix: tuple[int, int] = SUFFIX_TOKENS,
                    output: tuple[int, int] = PREFIX_OUTPUT_TOKENS) -> list[Request]:
    """``rate x seconds`` requests at Poisson times, each one of ``prefixes`` shared prefixes
    (uniform) plus a unique suffix; lengths uniform in the inclusive ranges."""
    n = request_count(rate, seconds)
    rng = random.Random(f"prefix-workload-{seed}")
    requests = []
    for index, at in enumerate(poisson_times(rate, n, seed)):
        group = rng.randrange(prefixes)
        tail = rng.randint(*suffix)
        requests.append(Request(index, at, prefix_tokens + tail, rng.randint(*output), group, prefix_tokens))
    return requests


def bursty_requests(rate: float, seconds: float, seed: int, cv: float = BURST_CV,
                    mix: Sequence[tuple[str, float]] = CLASS_MIX) -> list[Request]:
    """The shared-prefix workload's requests (same prefixes, suffixes and outputs) at gamma
    times of CV ``cv`` instead of Poisson ones, each with an SLO class drawn from ``mix``
    (seeded, independent of the lengths)."""
    shared = prefix_requests(rate, seconds, seed)
    times = gamma_times(rate, cv, len(shared), seed)
    rng = random.Random(f"classes-{seed}")
    names, weights = [name for name, _ in mix], [weight for _, weight in mix]
    return [replace(r, at_s=at, slo_class=rng.choices(names, weights)[0]) for r, at in zip(shared, times)]


def words_text(rng: random.Random, words: Sequence[str], n: int) -> str:
    return " ".join(rng.choices(words, k=n))


def prompt_text(request: Request, words: Sequence[str], seed: int) -> str:
    """The request's prompt: its shared prefix (the same text for every request of the
    group, seeded by the group) then words unique to the request. With single-token words,
    N words are N tokens (the first may take two)."""
    own = words_text(random.Random(f"request-{seed}-{request.index}"), words,
                     request.prompt_tokens - request.prefix_tokens)
    if request.prefix_id is None:
        return own
    prefix = words_text(random.Random(f"prefix-{seed}-{request.prefix_id}"), words, request.prefix_tokens)
    return f"{prefix} {own}" if own else prefix


def single_token_words(tokenizer_json: Path) -> list[str]:
    """Alphabetic words that the tokenizer encodes, with their leading space, as one token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    words = sorted(t[1:] for t in tokenizer.get_vocab() if t.startswith("Ġ") and t[1:].isalpha())
    return [w for w in words if len(tokenizer.encode(" " + w).ids) == 1]


def chars_per_token(words: Sequence[str]) -> float:
    """Mean characters per token of text made of ``words`` (each one token, plus a space)."""
    return sum(len(w) + 1 for w in words) / len(words)


def workload_requests(workload: str, rate: float, seconds: float, seed: int,
                      azure_lengths: Sequence[tuple[int, int]] | None = None) -> list[Request]:
    if workload == "azure":
        if azure_lengths is None:
            azure_lengths = bundled_azure_lengths()
        return azure_requests(rate, seconds, seed, azure_lengths)
    if workload == "prefix":
        return prefix_requests(rate, seconds, seed)
    if workload == "bursty":
        return bursty_requests(rate, seconds, seed)
    raise ValueError(f"unknown workload {workload!r}")


def bundled_azure_lengths() -> list[tuple[int, int]]:
    from sglang_ext.sim.workloads import bundled_sample

    return [(r.prompt_tokens, r.output_tokens) for r in bundled_sample().requests]

"""Running a load generator against a server: its inputs (the bundled trace's head for a
rate, a random-words dataset), its command line, its run with a log, flushing the server's
prefix cache between runs, and the per-request records of ``sglang.benchmark.serving``'s
result for the simulator's summaries."""

from __future__ import annotations

import json
import math
import random
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.server.emulated import MAX_PROMPT_TOKENS
from benchmarks.support.paths import REPO
from sglang_ext.policy.slo import Slo
from sglang_ext.sim.metrics import RequestRecord

#: the per-request lists ``sglang.benchmark.serving --output-details`` adds to its result
SERVING_DETAILS = ("input_lens", "output_lens", "ttfts", "itls", "errors")

_WORDS = (
    "large language model serving systems batch many requests into every forward step a "
    "prefill processes the prompt tokens of new and decode produces one token for each "
    "running request scheduler decides which join next how chunk may take when wait time "
    "to first per output are latency targets that users feel throughput is what operator "
    "pays quick brown fox jumps over lazy dog numbers"
).split()


def write_random_dataset(path: Path, conversations: int, words: int = 1400, seed: int = 0) -> Path:
    """A ShareGPT-format file for ``--dataset-name random``: each conversation's first turn
    is ``words`` random words (more than 1024 tokens with the tiny model's tokenizer), so the
    prompts a benchmark cuts from different conversations share no prefix."""
    rng = random.Random(seed)
    rows = [
        {"id": str(i), "conversations": [
            {"from": "human", "value": " ".join(rng.choices(_WORDS, k=words))},
            {"from": "gpt", "value": " ".join(rng.choices(_WORDS, k=20))},
        ]}
        for i in range(conversations)
    ]
    path.write_text(json.dumps(rows))
    return path


def replay_head_seconds(rate: float, target_s: float) -> float:
    """The shortest head (whole seconds of the bundled trace) whose requests, rescaled to
    ``rate``, arrive over at least ``target_s`` seconds."""
    from sglang_ext.sim.workloads import bundled_sample

    trace = bundled_sample()
    total = trace.requests[-1].arrival_s - trace.requests[0].arrival_s
    for head in range(5, int(total) + 1):
        if (len(trace.head(head).requests) - 1) / rate >= target_s:
            return float(head)
    return float(math.ceil(total))


def replay_command(url: str, rate: float, head_s: float, arrivals: str, seed: int,
                   slo_mix: str, output: Path, priority: str = "none") -> list[str]:
    """``python -m benchmarks.server.trace_replay`` of the bundled trace's head, prompts
    capped at :data:`~benchmarks.server.emulated.MAX_PROMPT_TOKENS`; ``priority`` (a mode
    of :mod:`benchmarks.server.priority`) is passed on unless it is ``"none"``."""
    command = [
        sys.executable, "-m", "benchmarks.server.trace_replay", "--url", url,
        "--rate", f"{rate:g}", "--head", f"{head_s:g}", "--arrivals", arrivals,
        "--seed", str(seed), "--slo-mix", slo_mix,
        "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--out", str(output),
    ]  # fmt: skip
    if priority != "none":
        command += ["--priority", priority]
    return command


def run_command(command: Sequence[str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    """Run ``command`` in the checkout, its output (after a ``$ command`` line) in
    ``log_path``; (exit code, -9 on timeout; wall seconds)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = -9
    return code, time.monotonic() - start


def flush_cache(url: str) -> None:
    """``POST /flush_cache`` on an SGLang server (it waits up to 120 s for running requests)."""
    request = urllib.request.Request(f"{url}/flush_cache?timeout=120", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=180) as reply:
            reply.read()
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"/flush_cache: HTTP {error.code}: {error.read()[:200]!r}") from None


def serving_records(result: Mapping, slo: Slo, slo_class: str) -> list[RequestRecord] | None:
    """Per-request records of a ``sglang.benchmark.serving`` result written with
    ``--output-details`` (``None`` without them), for the simulator's summaries.

    The tool keeps each request's prompt and output length, TTFT and the gaps between the
    chunks it streamed. A record gets that TTFT and its output tokens spread evenly from the
    first to the last chunk, so its max-TPOT is the tool's own (mean) TPOT, ``(last -
    first) / (n - 1)``, and its SLO verdict the tool's ``--goodput`` rule (up to the few
    milliseconds between the last chunk and the end of the stream, which the tool's
    latency includes). A request with an error is aborted: a miss.
    """
    if not all(isinstance(result.get(key), list) for key in SERVING_DETAILS):
        return None
    records = []
    for index, (prompt, output, ttft, gaps, error) in enumerate(
            zip(*(result[key] for key in SERVING_DETAILS), strict=True)):
        record = RequestRecord(index, 0.0, slo, int(prompt), int(output), slo_class)
        if error or output < 1:
            record.aborted = True
        else:
            last = ttft + sum(gaps)
            record.on_token(0, ttft)
            for token in range(1, output):
                record.on_token(token, ttft + (last - ttft) * token / (output - 1))
        records.append(record)
    return records

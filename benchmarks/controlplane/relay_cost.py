"""Whether the gateway's stepped streaming earns its keep: control-plane CPU per streamed
token of ``controlplane.gateway_sse.relay`` (events ready together go out in one write;
once the headers are out, chunks are pushed from the SDK's receiving callback) against
aiohttp's own streaming, one awaited ``response.write`` per chunk
(:func:`benchmarks.controlplane.plain_relay.plain_relay`).

    python -m benchmarks.controlplane.relay_cost [--rates 5,20] [--rounds 3]
        [--seconds S] [--out DIR]

Both run in ``benchmarks.controlplane.http_cpu``'s harness, gateway mode (the daemon and
the gateway, two processes, beside two simulated ranks), on its ``short`` workload. The
plain relay runs from a scratch copy of this checkout (``git archive HEAD``) whose
``controlplane/gateway_sse.py`` ends by rebinding ``relay`` to the plain one.
Rounds are interleaved (stepped, then plain, at every rate) so that the machine's load
touches both alike. Prints the median per relay and rate and writes
``OUT/relay_cost.{md,json}`` (every row, the machine and the commit).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from benchmarks.controlplane.cpu_cost import machine_load
from benchmarks.controlplane.http_cpu import SECONDS, run
from benchmarks.support.machine import machine_info, machine_line
from benchmarks.support.outputs import write_outputs
from benchmarks.support.paths import REPO

RATES = (5.0, 20.0)
ROUNDS = 3
REBIND = "\nfrom benchmarks.controlplane.plain_relay import plain_relay as relay  # noqa: E402,F811\n"


def plain_checkout(dest: Path) -> Path:
    """This checkout's HEAD in ``dest``, its gateway streaming with the plain relay."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    with (dest / "controlplane" / "gateway_sse.py").open("a") as module:
        module.write(REBIND)
    return dest


def table(rows: list[dict], rates: list[float]) -> str:
    lines = ["| rate, req/s | stepped, µs/token | plain, µs/token | plain / stepped |", "|---|---|---|---|"]
    for rate in rates:
        medians = {relay: statistics.median(r["control_plane_cpu_us_per_token"] for r in rows
                                            if r["relay"] == relay and r["rate"] == rate)
                   for relay in ("stepped", "plain")}
        lines.append(f"| {rate:g} | {medians['stepped']:.1f} | {medians['plain']:.1f} | "
                     f"{medians['plain'] / medians['stepped']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES),
                        help="comma-separated arrival rates, req/s")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds per rate")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="seconds of arrivals per run")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "relay_cost", help="output directory")
    args = parser.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        parser.error(f"--rates takes numbers separated by commas, got {args.rates!r}")
    if not rates or min(rates) <= 0 or args.rounds < 1 or args.seconds <= 0:
        parser.error("--rates, --rounds and --seconds must be positive")
    info = machine_info()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        sources = {"stepped": REPO, "plain": plain_checkout(Path(scratch) / "plain")}
        for round_index in range(args.rounds):
            for rate in rates:
                for relay, source in sources.items():
                    row = {"relay": relay, "round": round_index, "load_before": machine_load(),
                           **run(source, Path(scratch) / f"{relay}-{rate:g}-{round_index}", "gateway",
                                 args.seconds, rate),
                           "load_after": machine_load()}
                    print(f"{relay} {rate:g} req/s: {row['control_plane_cpu_us_per_token']} µs/token "
                          f"({row['finished']} finished, {row['failed']} failed)", file=sys.stderr)
                    rows.append(row)
    text = (f"Control-plane CPU per streamed token, median of {args.rounds} interleaved rounds "
            f"({args.seconds:g} s of arrivals each); {machine_line(info)}.\n\n{table(rows, rates)}\n")
    print(text)
    write_outputs(args.out, "relay_cost", text, {
        "command": "python -m benchmarks.controlplane.relay_cost " + " ".join(argv or sys.argv[1:]),
        "machine": info, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

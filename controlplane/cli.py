"""``fairbatching-controlplane`` (also ``python -m controlplane``): run the daemon, ask a
running one for its status and its ranks, drain and resume a rank, serve the
OpenAI-compatible HTTP gateway (``gateway``, ``serve --http``: its options and
:func:`parse_listen`), write CURVE keys."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from controlplane.cli_args import positive_float, positive_int, refuse_repeats
from controlplane.client import DEFAULT_ADDRESS, AsyncClient
from controlplane.config import ConfigError, DaemonConfig
from controlplane.curve import CurveError, CurvePeer, generate
from controlplane.errors import DaemonUnavailable
from controlplane.openai_api import DEFAULT_CHAT_MAX_TOKENS
from controlplane.protocol import DrainReply, RankStatus, StatusReply

GATEWAY_MAX_IN_FLIGHT = 1024  # gateway.DEFAULT_MAX_IN_FLIGHT, without importing aiohttp here

EXIT_OK, EXIT_UNEXPECTED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NO_SUCH_RANK, EXIT_STILL_BUSY = range(6)
EXIT_CODES = """exit codes:
  0  success
  1  unexpected error
  2  usage or config error
  3  daemon unreachable (no reply within --timeout)
  4  no rank of that name (drain, resume)
  5  drain --wait: requests still in flight at --wait-timeout"""
RANK_COLUMNS = ("rank", "agent", "epoch", "PAB", "reported PAB", "running", "waiting", "in flight",
                "report age", "stale", "draining", "seq gaps", "class budgets")
DRAIN_POLL_S = 0.2
DEFAULT_MODEL = "fairbatching"
#: the gateway's HTTP options: (flag, argparse dest, default)
HTTP_OPTIONS = (("--model", "model", DEFAULT_MODEL),
                ("--chat-max-tokens", "chat_max_tokens", DEFAULT_CHAT_MAX_TOKENS),
                ("--max-in-flight", "max_in_flight", GATEWAY_MAX_IN_FLIGHT),
                ("--slo-hints", "slo_hints", None),
                ("--api-key-file", "api_key_file", None),
                ("--allow-non-loopback", "allow_non_loopback", False))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a bug: one line, not a traceback, and its own exit code
        print(f"error: unexpected {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_UNEXPECTED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairbatching-controlplane",
        description=textwrap.fill("The FairBatching control plane: a daemon that routes requests to "
                                  "data-parallel ranks on their prefill admission budget (see "
                                  "docs/controlplane.md)."),
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    serve = _command(commands, "serve", "run the daemon until SIGTERM or SIGINT (then drain)",
                     "Run the daemon in the foreground; logs are JSON lines on stderr. SIGTERM or "
                     "SIGINT stops it gracefully: new requests are refused, in-flight ones get "
                     "drain_timeout_s to finish, and it exits 0. It exits 1 when it cannot bind "
                     "an address, 2 on a config error.")
    serve.add_argument("--config", metavar="PATH",
                       help="TOML file with a [daemon] table (e.g. configs/controlplane.toml); "
                            "every key is optional. Default: all defaults, loopback addresses")
    serve.add_argument("--http", metavar="HOST:PORT",
                       help="also serve the OpenAI-compatible HTTP API (as `gateway` does) from this "
                            "process: one process instead of two, and one hop fewer per engine step "
                            "(less CPU per streamed token); the options below apply with it")
    _http_arguments(serve)
    serve.set_defaults(run=_serve)

    status = _command(commands, "status", "summarise a running daemon",
                      "Print a running daemon's id, policy, uptime, drain state, requests in flight "
                      "and queued, rank count and counters.")
    ranks = _command(commands, "ranks", "list a running daemon's ranks and their load",
                     "Print one row per registered rank: agent, epoch, effective and reported PAB "
                     "(prefill admission budget, tokens), running and waiting requests, requests in "
                     "flight from the daemon, report age, staleness and report sequence gaps.")
    for command, show in ((status, _show_status), (ranks, _show_ranks)):
        _daemon_arguments(command)
        command.add_argument("--json", action="store_true", help="print JSON instead of text")
        command.set_defaults(run=_ask, show=show)

    drain = _command(commands, "drain", "stop dispatching to a rank; its requests run on",
                     "Tell a running daemon to send no new request to RANK; requests already on it "
                     "run to completion. With --wait, wait until none is left in flight (then the "
                     "rank's server can be stopped or restarted without failing a request). The "
                     "drain lasts until `resume`, until the rank leaves or restarts with a new "
                     "epoch, or until the daemon restarts.")
    resume = _command(commands, "resume", "dispatch to a drained rank again",
                      "Undo `drain`: RANK gets new requests again.")
    drain.add_argument("--wait", action="store_true",
                       help="wait until the rank has no request in flight (or has left)")
    drain.add_argument("--wait-timeout", type=positive_float, default=600.0, metavar="S",
                       help="give up waiting after S seconds, exit 5 (default: %(default)s)")
    for command, flag in ((drain, True), (resume, False)):
        command.add_argument("rank", metavar="RANK", help="the rank's name, as `ranks` lists it")
        _daemon_arguments(command, several=True)
        command.set_defaults(run=_drain, drain=flag)

    gateway = _command(commands, "gateway", "serve an OpenAI-compatible HTTP API in front of a daemon",
                       "Serve POST /v1/completions and /v1/chat/completions (streamed or not), GET /v1/models, /health and "
                       "/metrics (Prometheus) over HTTP, forwarding every request to the daemon "
                       "through the SDK (retries included). Once listening it prints one line on "
                       "stderr: where, the served model and the daemon. Runs until SIGTERM or "
                       "SIGINT; exits 1 when it cannot listen, 2 on a usage error.")
    gateway.add_argument("--daemon", action="append", metavar="ADDRESS",
                         help=f"the daemon's client address (default: {DEFAULT_ADDRESS}); repeat it "
                              "for active-active daemons: the gateway uses one at a time, starting "
                              "at a random one, and moves to the next when it is lost, resubmitting "
                              "the requests that had no output yet there")
    gateway.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT",
                         help="where to serve HTTP (default: %(default)s)")
    _http_arguments(gateway)
    _curve_arguments(gateway)
    gateway.set_defaults(run=_gateway)

    keygen = _command(commands, "keygen", "write a CURVE key pair",
                      "Write DIR/NAME.key (the public key: copy it to the daemon's "
                      "curve_authorized_keys_dir, or to peers for the daemon's own) and "
                      "DIR/NAME.key_secret (the pair, readable by its owner only). Existing files "
                      "are never overwritten.")
    keygen.add_argument("directory", metavar="DIR")
    keygen.add_argument("name", metavar="NAME", help="e.g. daemon, gpu-a, cli")
    keygen.set_defaults(run=_keygen)
    refuse_repeats(parser, {"--listen": "the gateway serves one address; start one per address",
                            "--http": "the gateway serves one address; start one per address"})
    return parser


def _http_arguments(command: argparse.ArgumentParser) -> None:
    """The gateway's HTTP options (``gateway``, and ``serve --http``)."""
    command.add_argument("--model", default=DEFAULT_MODEL,
                         help="the served model name, which /v1/models lists and answers carry when a "
                              "request names none; a request may name any model (default: %(default)s)")
    command.add_argument("--chat-max-tokens", type=_max_tokens, default=DEFAULT_CHAT_MAX_TOKENS, metavar="N",
                         help="output limit of a chat request that sets neither max_completion_tokens nor "
                              "max_tokens (default: %(default)s; vLLM and SGLang run such a request to the "
                              "end of the context, which the gateway does not know, and SGLang refuses a "
                              "limit past it; the default is twice the longest reply of the Azure "
                              "conversation trace, so a reply that ends on its own is practically never "
                              "cut)")
    command.add_argument("--max-in-flight", type=positive_int, default=GATEWAY_MAX_IN_FLIGHT, metavar="N",
                         help="completion requests the gateway holds at once, waiting for the daemon or "
                              "streaming; one more is answered 429 with Retry-After at once instead of "
                              "waiting (default: %(default)s). Behind it the daemon answers 429 (with "
                              "Retry-After) for a request no rank's budget can take within its TTFT "
                              "target, or when its own queue or in-flight limit is full; the SDK inside "
                              "retries those up to 3 times before the 429 reaches the client")
    command.add_argument("--slo-hints", metavar="FILE",
                         help="how a request without an slo of its own gets one from OpenAI's "
                              "service_tier, SGLang's priority and the x-smg-priority and "
                              "x-llm-d-slo-ttft-ms / -tpot-ms headers: a TOML table (default: "
                              "configs/slo_hints.toml's: flex -> relaxed, priority -> interactive; "
                              "priority ranks relaxed, standard, interactive; smg's bulk -> relaxed, "
                              "default -> standard, interactive and system -> interactive)")
    command.add_argument("--api-key-file", metavar="FILE",
                         help="require 'Authorization: Bearer <the file's first line>' (not on /health)")
    command.add_argument("--allow-non-loopback", action="store_true",
                         help="allow a non-loopback address to listen on (plain HTTP)")


def _daemon_arguments(command: argparse.ArgumentParser, several: bool = False) -> None:
    """How a command reaches a running daemon: its address, a reply timeout, CURVE keys.
    ``several``: ``--address`` may be repeated (the command runs against each daemon)."""
    if several:
        command.add_argument("--address", action="append", metavar="ADDRESS",
                             help=f"the daemon's client address (default: {DEFAULT_ADDRESS}); "
                                  "repeat it for active-active daemons: each one is told, in turn")
    else:
        command.add_argument("--address", default=DEFAULT_ADDRESS,
                             help="the daemon's client address (default: %(default)s)")
    command.add_argument("--timeout", type=positive_float, default=2.0, metavar="S",
                         help="seconds to wait for each reply (default: %(default)s)")
    _curve_arguments(command)


def _curve_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--curve-server-key", metavar="FILE",
                         help="the daemon's public key (.key), when it serves CURVE")
    command.add_argument("--curve-secret-key", metavar="FILE",
                         help="this client's key pair (.key_secret); its .key must be authorized")


def _client(args: argparse.Namespace, address: str | None = None) -> AsyncClient:
    curve = CurvePeer.from_optional_files(args.curve_server_key, args.curve_secret_key)
    return AsyncClient(address or args.address, connect_timeout_s=args.timeout, curve=curve)


def _gateway(args: argparse.Namespace) -> int:
    try:
        gateway, settings, host, port = _http_settings(args, args.listen)
        curve = CurvePeer.from_optional_files(args.curve_server_key, args.curve_secret_key)
        if args.daemon and len(set(args.daemon)) != len(args.daemon):
            raise ValueError(f"--daemon names one daemon twice: {args.daemon}")
    except (ValueError, OSError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        async with AsyncClient(args.daemon or DEFAULT_ADDRESS, curve=curve) as client:
            await gateway.serve(client, settings, host, port, stop, announce=_to_stderr)

    import uvloop

    try:
        uvloop.run(main())
    except OSError as error:
        print(f"error: cannot listen on {args.listen}: {error}", file=sys.stderr)
        return EXIT_UNEXPECTED
    return EXIT_OK


def _http_settings(args: argparse.Namespace, listen: str, flag: str = "--listen"):
    """The gateway module, its settings and where to listen; ImportError without aiohttp,
    ValueError or OSError for a bad address or API key file."""
    try:
        from controlplane import gateway
    except ImportError as error:
        raise ImportError(f"the gateway needs aiohttp ({error})") from None
    host, port = parse_listen(listen, args.allow_non_loopback, flag)
    api_key = _read_api_key(args.api_key_file) if args.api_key_file else None
    from controlplane.slo_hints import SloHints
    hints = SloHints.load(Path(args.slo_hints)) if args.slo_hints else SloHints()
    settings = gateway.GatewaySettings(model=args.model, api_key=api_key, chat_max_tokens=args.chat_max_tokens,
                                       max_in_flight=args.max_in_flight, slo_hints=hints)
    return gateway, settings, host, port


def parse_listen(text: str, allow_non_loopback: bool, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets); loopback unless ``allow_non_loopback``. ``flag``
    names the option in the errors."""
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{flag} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    if host not in ("127.0.0.1", "localhost", "::1") and not allow_non_loopback:
        raise ValueError(f"{flag} {text!r} is not loopback; the gateway speaks plain HTTP, so say "
                         "--allow-non-loopback (and set --api-key-file) to expose it")
    return host, int(port_text)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _read_api_key(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        key = handle.readline().strip()
    if not key:
        raise ValueError(f"{path}: the first line (the API key) is empty")
    return key


def _keygen(args: argparse.Namespace) -> int:
    try:
        public, secret = generate(args.directory, args.name)
    except (CurveError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(f"public key {public}\nkey pair   {secret}")
    return EXIT_OK


def _command(commands, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=summary, epilog=EXIT_CODES,
                               description=textwrap.fill(description, break_on_hyphens=False),
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def _max_tokens(text: str) -> int:
    return positive_int(text, maximum=1_000_000)


def _serve(args: argparse.Namespace) -> int:
    try:
        config = DaemonConfig.load(args.config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.http is None:
        given = [flag for flag, dest, default in HTTP_OPTIONS if getattr(args, dest) != default]
        if given:
            print(f"error: {', '.join(given)} only apply with --http", file=sys.stderr)
            return EXIT_USAGE
        from controlplane import daemon

        return daemon.run(config)
    try:
        _, settings, host, port = _http_settings(args, args.http, "--http")
    except (ValueError, OSError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    from controlplane import embedded

    return embedded.run(config, settings, host, port, announce=_to_stderr)


def _ask(args: argparse.Namespace) -> int:
    async def fetch() -> StatusReply:
        async with _client(args) as client:
            return await client.status()

    return _talk(fetch, lambda reply: (args.show(reply, args.json), EXIT_OK)[1])


def _drain(args: argparse.Namespace) -> int:
    """Drain or resume the rank at each daemon named, in turn; the first failure ends it."""
    addresses = args.address or [DEFAULT_ADDRESS]
    several = len(addresses) > 1
    for address in addresses:
        code = _drain_at(args, address, several)
        if code != EXIT_OK:
            return code
    return EXIT_OK


def _drain_at(args: argparse.Namespace, address: str, several: bool) -> int:
    where = f" at {address}" if several else ""

    async def drain() -> tuple[DrainReply, int | None]:
        async with _client(args, address) as client:
            reply = await client.drain_rank(args.rank, args.drain)
            if not (reply.known and args.drain and args.wait):
                return reply, None
            return reply, await _in_flight_after_wait(client, args.rank, args.wait_timeout)

    def show(outcome: tuple[DrainReply, int | None]) -> int:
        reply, left = outcome
        if not reply.known:
            print(f"error: the daemon{where} has no rank named {args.rank!r} (see `ranks`)", file=sys.stderr)
            return EXIT_NO_SUCH_RANK
        verb = "draining" if reply.draining else "resumed"
        print(f"rank {reply.rank}{where}: {verb}, {reply.in_flight} in flight")
        if left is None:
            return EXIT_OK
        if left:
            print(f"rank {reply.rank}{where}: {left} still in flight after {args.wait_timeout:g} s",
                  file=sys.stderr)
            return EXIT_STILL_BUSY
        print(f"rank {reply.rank}{where}: drained")
        return EXIT_OK

    return _talk(drain, show)


async def _in_flight_after_wait(client: AsyncClient, rank: str, timeout_s: float) -> int:
    """Requests the daemon still has in flight on ``rank`` once none are, the rank has
    left, or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await client.status()
        left = sum(r.in_flight for r in status.ranks if r.rank == rank)
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))


def _talk(conversation, show) -> int:
    """Run ``conversation`` against the daemon and ``show`` its outcome (an exit code)."""
    try:
        outcome = asyncio.run(conversation())
    except DaemonUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ValueError as error:  # an address ZMQ cannot connect to, a bad key file
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    return show(outcome)


def _show_status(reply: StatusReply, as_json: bool) -> None:
    if as_json:
        print(msgspec.json.encode(reply).decode())
        return
    stale = sum(rank.stale for rank in reply.ranks)
    rows = [("daemon", reply.daemon_id), ("policy", reply.policy), ("uptime", f"{reply.uptime_s:.1f} s"),
            ("draining", "yes" if reply.draining else "no"), ("in flight", str(reply.in_flight)),
            ("queued", str(reply.queued)), ("ranks", f"{len(reply.ranks)} ({stale} stale)")]
    print("\n".join(f"{key:<10} {value}" for key, value in rows))
    if reply.counters:
        width = max(map(len, reply.counters))
        print("counters")
        print("\n".join(f"  {name:<{width}}  {reply.counters[name]}" for name in sorted(reply.counters)))


def _show_ranks(reply: StatusReply, as_json: bool) -> None:
    if as_json:
        print(msgspec.json.encode(reply.ranks).decode())
    elif not reply.ranks:
        print("no ranks registered")
    else:
        print(_table(RANK_COLUMNS, [_rank_row(rank) for rank in reply.ranks]))


def _rank_row(rank: RankStatus) -> tuple[str, ...]:
    def tokens(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    age = "-" if rank.report_age_s is None else f"{rank.report_age_s:.2f} s"
    return (rank.rank, rank.agent, str(rank.epoch), tokens(rank.pab_tokens), tokens(rank.reported_pab_tokens),
            str(rank.running), str(rank.waiting), str(rank.in_flight), age, "yes" if rank.stale else "no",
            "yes" if rank.draining else "no", str(rank.seq_gaps),
            ",".join(f"{name}={tokens(value)}" for name, value in sorted(rank.class_budgets.items())) or "-")


def _table(header: Sequence[str], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in (tuple(header), *rows))

"""The daemon's configuration: one TOML file (see ``configs/controlplane.toml``).

Every field has a default, so an empty file (or none) is a loopback daemon with the
``pab_cache_aware`` policy (prefix-cache affinity within each rank's PAB: a request goes
where its prefix is cached unless that rank's budget cannot take it; no cached match: as
``pab_least_loaded``, PAB admits and load chooses, since plain ``pab`` herds). Why it is
the default: docs/controlplane.md (*A request's life*, 2), docs/bench/routers.md. A wrong key, type
or range raises :class:`ConfigError` naming the file and the field.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta, Struct

from controlplane.curve import CurveError, authorized_keys_dir, load_key_pair
from controlplane.loop_router import serves as loop_serves

PositiveFloat = Annotated[float, Meta(gt=0.0)]
PositiveInt = Annotated[int, Meta(gt=0)]
PolicyName = Literal[
    "pab", "pab_least_loaded", "pab_cache_aware", "cache_aware", "round_robin", "request_count",
    "total_tokens", "power_of_two",
]
OnNoBudget = Literal["reject", "queue", "spill"]
Transport = Literal["auto", "loop", "zmq"]
ON_NO_BUDGET: tuple[str, ...] = get_args(OnNoBudget)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


class ConfigError(ValueError):
    """A malformed daemon config; the message names the file and the field."""


class DaemonConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    client_address: str = "tcp://127.0.0.1:5560"
    rank_address: str = "tcp://127.0.0.1:5561"
    report_address: str = "tcp://127.0.0.1:5562"
    allow_non_loopback: bool = False  # plaintext beyond loopback must be asked for
    curve_secret_key_file: str | None = None  # the daemon's .key_secret: CURVE on every socket
    curve_authorized_keys_dir: str | None = None  # the .key files of every peer let in

    policy: PolicyName = "pab_cache_aware"  # prefix affinity within each rank's PAB
    on_no_budget: OnNoBudget = "reject"
    retry_after_s: PositiveFloat = 0.25
    queue_ttl_s: PositiveFloat = 5.0  # the longest wait; a request with a TTFT target waits at most that
    max_queued: PositiveInt = 1024
    max_in_flight: PositiveInt = 65536
    # the event loop's busy share (its thread's CPU time over wall time, about the last second)
    # at or above which new submits are refused overloaded: the daemon's own inputs are piling up
    max_loop_busy: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.95
    local_inflight_cap: PositiveInt = 64  # per rank, when every rank is stale
    chars_per_token: PositiveFloat = 4.0  # a text prompt's token estimate: its UTF-8 bytes / this
    chat_tokens_per_message: Annotated[int, Meta(ge=0, le=4096)] = 5  # a chat template's tokens per turn
    seed: int = 0  # power_of_two's sampling

    stale_after_s: PositiveFloat = 1.0
    heartbeat_interval_s: PositiveFloat = 0.5
    lost_after_s: PositiveFloat = 3.0
    drain_timeout_s: Annotated[float, Meta(ge=0.0)] = 10.0

    max_frame_bytes: Annotated[int, Meta(ge=1024, le=256 * 1024 * 1024)] = 4 * 1024 * 1024
    send_hwm: PositiveInt = 10_000
    recv_hwm: PositiveInt = 10_000
    # the client and rank sockets: "loop" served on the event loop's thread (the daemon speaks
    # ZMTP to its peers' libzmq sockets itself: no thread wake-up per message), "zmq" through
    # libzmq's I/O thread, "auto" the loop wherever it can (neither CURVE nor inproc://)
    transport: Transport = "auto"

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    daemon_id: str = ""  # empty: a fresh random id per start

    def __post_init__(self) -> None:
        for key in ("client_address", "rank_address", "report_address"):
            address = getattr(self, key)
            if not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{key} = {address!r}: expected tcp://host:port, ipc:// or inproc://")
            if address.startswith("tcp://") and not (self.allow_non_loopback or self.curve):
                host = address.removeprefix("tcp://").rsplit(":", 1)[0]
                if host not in LOOPBACK_HOSTS:
                    raise ValueError(
                        f"{key} = {address!r} is not loopback; configure CURVE "
                        "(curve_secret_key_file, curve_authorized_keys_dir) or set "
                        "allow_non_loopback = true to bind it in plaintext, unauthenticated"
                    )
        if (self.curve_secret_key_file is None) != (self.curve_authorized_keys_dir is None):
            raise ValueError("curve_secret_key_file and curve_authorized_keys_dir go together")
        if self.curve:
            try:
                load_key_pair(self.curve_secret_key_file)
                authorized_keys_dir(self.curve_authorized_keys_dir)
            except CurveError as error:
                raise ValueError(str(error)) from None
        if self.lost_after_s <= self.heartbeat_interval_s:
            raise ValueError("lost_after_s must exceed heartbeat_interval_s")
        if self.transport == "loop" and not self._loop_can_serve():
            addresses = f"client_address = {self.client_address!r}, rank_address = {self.rank_address!r}"
            raise ValueError(
                f"transport = \"loop\" serves tcp://IP:PORT and ipc:// addresses without CURVE; "
                f"{addresses}{' with CURVE' if self.curve else ''} need \"zmq\" or \"auto\"")

    def _loop_can_serve(self) -> bool:
        return not self.curve and loop_serves(self.client_address) and loop_serves(self.rank_address)

    @property
    def routers_on_loop(self) -> bool:
        """Whether the client and rank sockets are served on the event loop (``transport``)."""
        if self.transport == "auto":
            return self._loop_can_serve()
        return self.transport == "loop"

    @property
    def curve(self) -> bool:
        return self.curve_secret_key_file is not None

    @classmethod
    def load(cls, path: str | Path | None) -> DaemonConfig:
        """The ``[daemon]`` table of ``path`` (None: all defaults)."""
        if path is None:
            return cls()
        path = Path(path)
        try:
            document = tomllib.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except OSError as error:
            raise ConfigError(f"{path}: cannot read config file: {error.strerror or error}") from None
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"{path}: invalid TOML: {error}") from None
        unknown = set(document) - {"daemon"}
        if unknown:
            raise ConfigError(f"{path}: unknown table or key {sorted(unknown)}; expected [daemon]")
        return cls.from_mapping(document.get("daemon", {}), source=str(path))

    @classmethod
    def from_mapping(cls, table: object, source: str = "<config>") -> DaemonConfig:
        try:
            return msgspec.convert(table, cls)
        except msgspec.ValidationError as error:
            message = str(error).replace("$.", "daemon.").replace("`$`", "[daemon]")
            raise ConfigError(f"{source}: {message}") from None

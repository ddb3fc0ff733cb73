"""CURVE (ZeroMQ's Curve25519 encryption and authentication) for the control plane's sockets.

Keys are ZeroMQ certificate files (:mod:`zmq.auth`): ``NAME.key`` holds a public key,
``NAME.key_secret`` the pair; ``fairbatching-controlplane keygen DIR NAME`` writes both.

- The daemon serves CURVE on all three sockets with its own pair
  (``curve_secret_key_file``) and lets in only peers whose public key is in
  ``curve_authorized_keys_dir`` (read once at start); anyone else fails the handshake
  and never reaches the daemon's code.
- A peer (SDK, CLI, rank agent, report publisher) needs the daemon's public key and its
  own pair: :class:`CurvePeer`.

Without CURVE the sockets are plaintext and unauthenticated, which is why the daemon
binds loopback only unless told otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth


class CurveError(ValueError):
    """A key file is missing, unreadable or not a CURVE certificate."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes
    secret: bytes


def load_key_pair(path: str | os.PathLike[str]) -> KeyPair:
    """The pair in a ``.key_secret`` certificate."""
    public, secret = _load(path)
    if secret is None:
        raise CurveError(f"{path}: no secret key in this file (use the .key_secret file)")
    return KeyPair(public, secret)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The public key of a ``.key`` (or ``.key_secret``) certificate."""
    return _load(path)[0]


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise CurveError(f"{path}: no such key file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as error:
        raise CurveError(f"{path}: not a CURVE certificate ({error})") from None
    if public is None or len(public) != 40:
        raise CurveError(f"{path}: not a CURVE certificate (no Z85 public-key)")
    return public, secret


@dataclass(frozen=True, slots=True)
class CurvePeer:
    """What a connecting socket needs: the daemon's public key and its own pair."""

    server_public: bytes
    keys: KeyPair

    @classmethod
    def from_files(cls, server_key_file: str | os.PathLike[str],
                   secret_key_file: str | os.PathLike[str]) -> CurvePeer:
        return cls(load_public_key(server_key_file), load_key_pair(secret_key_file))

    @classmethod
    def from_optional_files(cls, server_key_file: str | os.PathLike[str] | None,
                            secret_key_file: str | os.PathLike[str] | None) -> CurvePeer | None:
        """None when neither file is given (plaintext); both or neither."""
        if (server_key_file is None) != (secret_key_file is None):
            raise CurveError("the daemon's public key and this peer's key pair go together")
        return None if server_key_file is None else cls.from_files(server_key_file, secret_key_file)

    def apply(self, socket: zmq.Socket) -> None:
        """Before ``connect``."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.keys.public
        socket.curve_secretkey = self.keys.secret


def serve_curve(socket: zmq.Socket, keys: KeyPair) -> None:
    """Make ``socket`` a CURVE server (before ``bind``)."""
    socket.curve_server = True
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret


def authorized_keys_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is a directory holding at least one ``.key`` certificate."""
    directory = Path(path)
    if not directory.is_dir():
        raise CurveError(f"{path}: no such directory of authorized public keys")
    keys = sorted(directory.glob("*.key"))
    if not keys:
        raise CurveError(f"{path}: no *.key public key files; nobody could connect")
    for key in keys:
        load_public_key(key)
    return directory


def generate(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (owner-only) into ``directory``."""
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"invalid key name {name!r}")
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = target / f"{name}.key", target / f"{name}.key_secret"
    for existing in (public_file, secret_file):
        if existing.exists():
            raise CurveError(f"{existing} exists; not overwriting a key")
    public_path, secret_path = zmq.auth.create_certificates(target, name)
    os.chmod(secret_path, 0o600)
    return Path(public_path), Path(secret_path)

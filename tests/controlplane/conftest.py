"""Fixtures shared by the control plane's tests, in-process and as processes."""

from __future__ import annotations

import pytest

from controlplane.curve import generate


@pytest.fixture
def keys(tmp_path):
    """daemon, rank and client pairs in keys/; the rank's and client's public keys in authorized/."""
    key_dir, authorized = tmp_path / "keys", tmp_path / "authorized"
    pairs = {name: generate(key_dir, name) for name in ("daemon", "rank", "client", "stranger")}
    authorized.mkdir()
    for name in ("rank", "client"):
        (authorized / f"{name}.key").write_bytes(pairs[name][0].read_bytes())
    return key_dir, authorized

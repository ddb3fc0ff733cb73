"""CURVE on the control plane: key files and config checks (a live CURVE daemon:
``tests/controlplane/processes/test_curve_daemon.py``)."""

from __future__ import annotations

import os
import stat

import pytest

from controlplane.config import ConfigError, DaemonConfig
from controlplane.curve import CurveError, generate, load_key_pair, load_public_key


def test_keygen_writes_a_pair_with_an_owner_only_secret_and_never_overwrites(tmp_path):
    public, secret = generate(tmp_path, "a")
    assert load_public_key(public) == load_key_pair(secret).public
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    with pytest.raises(CurveError, match="exists"):
        generate(tmp_path, "a")
    with pytest.raises(CurveError, match="no secret key"):
        load_key_pair(public)
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(CurveError, match="not a CURVE certificate"):
        load_public_key(tmp_path / "junk.key")
    with pytest.raises(CurveError, match="no such key file"):
        load_public_key(tmp_path / "missing.key")


def test_config_needs_both_curve_keys_readable_and_then_allows_non_loopback(keys, tmp_path):
    key_dir, authorized = keys
    secret = str(key_dir / "daemon.key_secret")
    with pytest.raises(ValueError, match="go together"):
        DaemonConfig(curve_secret_key_file=secret)
    with pytest.raises(ValueError, match="no such key file"):
        DaemonConfig(curve_secret_key_file=str(tmp_path / "nope"), curve_authorized_keys_dir=str(authorized))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="nobody could connect"):
        DaemonConfig(curve_secret_key_file=secret, curve_authorized_keys_dir=str(empty))
    with pytest.raises(ValueError, match="configure CURVE"):
        DaemonConfig(client_address="tcp://0.0.0.0:5560")
    config = DaemonConfig(client_address="tcp://0.0.0.0:5560", curve_secret_key_file=secret,
                          curve_authorized_keys_dir=str(authorized))
    assert config.curve and not config.allow_non_loopback
    path = tmp_path / "bad.toml"
    path.write_text(f'[daemon]\ncurve_secret_key_file = "{tmp_path}/nope"\ncurve_authorized_keys_dir = "{authorized}"\n')
    with pytest.raises(ConfigError, match="bad.toml.*no such key file"):
        DaemonConfig.load(path)


def test_curve_keeps_the_routers_on_libzmq_and_refuses_the_loop_transport(keys):
    key_dir, authorized = keys
    curve = {"curve_secret_key_file": str(key_dir / "daemon.key_secret"),
             "curve_authorized_keys_dir": str(authorized)}
    assert not DaemonConfig(**curve).routers_on_loop
    with pytest.raises(ValueError, match="with CURVE need"):
        DaemonConfig(transport="loop", **curve)

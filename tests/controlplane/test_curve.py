"""CURVE on the control plane: key files, config checks, and a live daemon that serves
authorized peers (SDK, CLI, a simulated rank's agent and reports) and nobody else."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time

import pytest

from benchmarks.controlplane.live_daemon import ProcessDaemon, loopback_config, write_config
from benchmarks.support.paths import REPO
from controlplane.cli import main
from controlplane.client import AsyncClient
from controlplane.config import ConfigError, DaemonConfig
from controlplane.curve import CurveError, CurvePeer, generate, load_key_pair, load_public_key
from controlplane.errors import DaemonUnavailable
from controlplane.protocol import FinishReason, SamplingParams


@pytest.fixture
def keys(tmp_path):
    """daemon, rank and client pairs in keys/; the rank's and client's public keys in authorized/."""
    key_dir, authorized = tmp_path / "keys", tmp_path / "authorized"
    pairs = {name: generate(key_dir, name) for name in ("daemon", "rank", "client", "stranger")}
    authorized.mkdir()
    for name in ("rank", "client"):
        (authorized / f"{name}.key").write_bytes(pairs[name][0].read_bytes())
    return key_dir, authorized


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


def test_a_curve_daemon_serves_authorized_peers_only(keys, tmp_path, capsys):
    key_dir, authorized = keys
    config = loopback_config(curve_secret_key_file=str(key_dir / "daemon.key_secret"),
                             curve_authorized_keys_dir=str(authorized), stale_after_s=2.0)
    daemon = start_curve_daemon(tmp_path, config, key_dir)
    rank = subprocess.Popen(
        [sys.executable, "-m", "sglang_ext.sim.rank", "--daemon", config.rank_address,
         "--report-address", config.report_address, "--agent-id", "secure", "--time-scale", "0.1",
         "--curve-server-key", str(key_dir / "daemon.key"), "--curve-secret-key", str(key_dir / "rank.key_secret"),
         "--log-level", "warning"], cwd=REPO, stderr=subprocess.DEVNULL)
    trusted = CurvePeer.from_files(key_dir / "daemon.key", key_dir / "client.key_secret")
    stranger = CurvePeer.from_files(key_dir / "daemon.key", key_dir / "stranger.key_secret")

    async def scenario():
        async with AsyncClient(config.client_address, curve=trusted) as client:
            deadline = time.monotonic() + 30
            while not [r for r in (await client.status()).ranks if not r.stale]:
                assert time.monotonic() < deadline, "the CURVE rank never joined and reported"
                await asyncio.sleep(0.1)
            result = await client.generate([3] * 40, sampling=SamplingParams(max_new_tokens=5, ignore_eos=True),
                                           slo="relaxed")
        refused = []
        for curve in (None, stranger):
            async with AsyncClient(config.client_address, curve=curve, connect_timeout_s=0.5) as outsider:
                try:
                    await outsider.status()
                except DaemonUnavailable:
                    refused.append(curve)
        return result, refused

    try:
        result, refused = asyncio.run(scenario())
        assert (result.finish_reason, result.completion_tokens, result.rank) == (FinishReason.LENGTH, 5, "secure")
        assert refused == [None, stranger]
        address = ["--address", config.client_address, "--curve-server-key", str(key_dir / "daemon.key")]
        assert main(["status", *address, "--curve-secret-key", str(key_dir / "client.key_secret")]) == 0
        assert "ranks      1 (0 stale)" in capsys.readouterr().out
        assert main(["status", *address, "--timeout", "0.5",
                     "--curve-secret-key", str(key_dir / "stranger.key_secret")]) == 3
        assert main(["status", *address, "--curve-secret-key", str(key_dir / "client.key")]) == 2
    finally:
        rank.kill()
        rank.wait(10)
        daemon.kill()


def start_curve_daemon(tmp_path, config, key_dir):
    """As live.start_process_daemon, but its readiness ping speaks CURVE."""
    config_path = write_config(tmp_path / "daemon.toml", config)
    log_path = tmp_path / "daemon.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "controlplane", "serve", "--config", str(config_path)],
                                   stdout=log, stderr=log, cwd=REPO)
    peer = CurvePeer.from_files(key_dir / "daemon.key", key_dir / "client.key_secret")

    async def ready() -> bool:
        deadline = time.monotonic() + 20
        async with AsyncClient(config.client_address, curve=peer, connect_timeout_s=0.5) as client:
            while time.monotonic() < deadline:
                try:
                    await client.ping()
                    return True
                except DaemonUnavailable:
                    continue
        return False

    running = ProcessDaemon(config, config_path, process, log_path)
    if not asyncio.run(ready()):
        running.kill()
        raise RuntimeError(f"CURVE daemon did not answer; log:\n{log_path.read_text()[-3000:]}")
    return running

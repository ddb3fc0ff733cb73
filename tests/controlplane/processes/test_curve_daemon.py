"""CURVE on the control plane: a live daemon process that serves authorized peers (SDK,
CLI, a simulated rank's agent and reports) and nobody else."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time


from benchmarks.controlplane.live_daemon import ProcessDaemon, loopback_config, write_config
from benchmarks.support.paths import REPO
from controlplane.cli import main
from controlplane.client import AsyncClient
from controlplane.curve import CurvePeer
from controlplane.errors import DaemonUnavailable
from controlplane.protocol import FinishReason, SamplingParams


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

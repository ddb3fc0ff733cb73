"""The SDK bound to a daemon in the same process (``controlplane.embedded.LocalClient``):
what it sends is checked as a socket's frames are, its replies come at the end of the
loop pass, and once the daemon has stopped it fails cleanly instead of touching closed
sockets. A real daemon on loopback, no ranks."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.controlplane.live_daemon import loopback_config
from controlplane.daemon import Daemon
from controlplane.embedded import LocalClient
from controlplane.errors import ControlPlaneError, DaemonUnavailable, NoRanks
from controlplane.protocol import Cancel


def test_a_local_client_talks_to_its_daemon_then_fails_cleanly_once_it_stopped() -> None:
    async def main():
        daemon = Daemon(loopback_config(stale_after_s=2.0))
        serving = asyncio.create_task(daemon.serve())
        await daemon.ready.wait()
        client = LocalClient(daemon, max_retries=0)
        pong = await client.ping(timeout_s=2.0)
        status = await client.status(timeout_s=2.0)
        with pytest.raises(NoRanks):
            await client.generate("hello", max_new_tokens=2)
        client._send(Cancel("bad id \x01"))  # refused as a socket's frame would be: dropped, counted
        counters = (await client.status(timeout_s=2.0)).counters
        with pytest.raises(RuntimeError, match="already attached"):
            daemon.attach_local(lambda message: None)
        daemon.request_drain()
        await serving
        with pytest.raises(DaemonUnavailable, match="the daemon has stopped"):
            client._send(Cancel("r-1"))
        sent_after_stop = client._try_send(Cancel("r-1"))
        await client.close()
        with pytest.raises(ControlPlaneError, match="closed"):
            await client.ping()
        return pong, status, counters, sent_after_stop

    pong, status, counters, sent_after_stop = asyncio.run(main())
    assert pong.daemon_id == status.daemon_id and status.ranks == []
    assert counters.get("frames_dropped_invalid") == 1
    assert sent_after_stop is False

"""The loop-served ROUTER against real libzmq peers: routing ids, handover, mandatory
routing, heartbeats, oversized frames, peers that break the protocol, the high-water mark."""

from __future__ import annotations

import asyncio
import socket as socketlib
import time

import pytest
import zmq

from benchmarks.support.ports import free_ports
from controlplane import zmtp
from controlplane.config import ConfigError, DaemonConfig
from controlplane.loop_router import LoopRouter, OversizedMessage, serves


class Harness:
    """A LoopRouter on a fresh loop with what it received, and libzmq peers."""

    def __init__(self, address: str, **options: int) -> None:
        self.received: list[tuple[bytes, list]] = []
        self.passes = 0
        self.router = LoopRouter(address, self._on_message, self._on_pass_end,
                                 max_frame_bytes=options.get("max_frame_bytes", 1 << 20),
                                 send_high_water_bytes=options.get("send_high_water_bytes", 1 << 20),
                                 handover=bool(options.get("handover", False)),
                                 handshake_timeout_s=options.get("handshake_timeout_s", 30.0))
        self.context = zmq.Context()
        self.peers: list[zmq.Socket] = []

    def _on_message(self, identity: bytes, parts: list) -> None:
        self.received.append((identity, [p if isinstance(p, OversizedMessage) else bytes(p) for p in parts]))

    def _on_pass_end(self) -> None:
        self.passes += 1

    def dealer(self, identity: bytes | None = None, *, kind: int = zmq.DEALER, **options: int) -> zmq.Socket:
        peer = self.context.socket(kind)
        peer.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            peer.setsockopt(zmq.ROUTING_ID, identity)
        for name, value in options.items():
            peer.setsockopt(getattr(zmq, name), value)
        peer.connect(self.router.address)
        self.peers.append(peer)
        return peer

    async def until(self, condition, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.005)

    def close(self) -> None:
        self.router.close()
        for peer in self.peers:
            peer.close()
        self.context.term()


def tcp_address() -> str:
    (port,) = free_ports(1)
    return f"tcp://127.0.0.1:{port}"


def run(test, address: str | None = None, **options: int) -> None:
    async def main() -> None:
        harness = Harness(address or tcp_address(), **options)
        try:
            await harness.router.start()
            await test(harness)
        finally:
            harness.close()
    asyncio.run(main())


def received_by(peer: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert peer.poll(timeout_ms), "nothing received"
    return peer.recv_multipart()


def test_a_dealer_is_known_by_its_routing_id_both_ways():
    async def test(h: Harness) -> None:
        agent = h.dealer(b"agent-1")
        agent.send(b"hello")
        await h.until(lambda: h.received)
        assert h.received == [(b"agent-1", [b"hello"])] and h.passes == 1
        assert h.router.send(b"agent-1", b"x" * 300)  # a long frame
        assert await asyncio.to_thread(received_by, agent) == [b"x" * 300]
    run(test)


def test_multipart_messages_keep_their_parts_and_a_dealer_without_an_id_gets_one():
    async def test(h: Harness) -> None:
        anonymous = h.dealer()
        anonymous.send_multipart([b"one", b"", b"three"])
        await h.until(lambda: h.received)
        identity, parts = h.received[0]
        assert parts == [b"one", b"", b"three"] and identity[:1] == b"\x00" and len(identity) == 5
        assert h.router.send(identity, b"back")
        assert await asyncio.to_thread(received_by, anonymous) == [b"back"]
    run(test)


def test_a_send_to_an_unknown_id_fails_as_under_router_mandatory():
    async def test(h: Harness) -> None:
        assert not h.router.send(b"nobody", b"x")
    run(test)


def test_a_new_connection_with_a_connected_id_takes_it_over():
    async def test(h: Harness) -> None:
        old = h.dealer(b"agent-h")
        old.send(b"from old")
        await h.until(lambda: len(h.received) == 1)
        new = h.dealer(b"agent-h")
        new.send(b"from new")
        await h.until(lambda: len(h.received) == 2)
        assert h.router.send(b"agent-h", b"to the new one")
        assert await asyncio.to_thread(received_by, new) == [b"to the new one"]
        assert not old.poll(200)
        assert h.router.peers == frozenset({b"agent-h"})
    run(test, handover=True)


def test_without_handover_a_second_connection_with_a_taken_id_is_turned_away():
    async def test(h: Harness) -> None:
        first = h.dealer(b"client-1")
        first.send(b"from the first")
        await h.until(lambda: len(h.received) == 1)
        second = h.dealer(b"client-1")
        second.send(b"from the second", zmq.NOBLOCK)
        await asyncio.sleep(0.2)
        assert h.router.send(b"client-1", b"to the first")
        assert await asyncio.to_thread(received_by, first) == [b"to the first"]
        assert h.received == [(b"client-1", [b"from the first"])]
    run(test)


async def raw_zmtp(h: Harness, identity: bytes):
    """A hand-made ZMTP peer stating ``identity``; what it reads until the router closes."""
    host, port = h.router.address.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(zmtp.greeting() + zmtp.ready(b"DEALER", {b"Identity": identity}) + zmtp.frame(b"hi"))
    received = b""
    while chunk := await asyncio.wait_for(reader.read(4096), 5):
        received += chunk
    writer.close()
    return received


def test_a_peer_may_not_state_an_id_that_starts_with_a_zero_byte():
    async def test(h: Harness) -> None:
        await raw_zmtp(h, b"\x00local")  # returns once the router closed the connection
        assert h.received == [] and h.router.peers == frozenset()
    run(test)


def test_pings_are_answered_so_a_dealer_with_heartbeats_stays_connected():
    async def test(h: Harness) -> None:
        agent = h.dealer(b"agent-hb", HEARTBEAT_IVL=50, HEARTBEAT_TIMEOUT=200, HEARTBEAT_TTL=200)
        monitor = agent.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        monitor.setsockopt(zmq.LINGER, 0)
        h.peers.insert(0, monitor)  # closed before the dealer it watches
        agent.send(b"first")
        await h.until(lambda: h.received)
        await asyncio.sleep(1.0)  # 20 heartbeat intervals, 5 timeouts
        assert not monitor.poll(0), "the dealer dropped the connection"
        agent.send(b"second")
        await h.until(lambda: len(h.received) == 2)
        assert h.router.peers == frozenset({b"agent-hb"})
    run(test)


def test_a_frame_over_the_limit_is_reported_oversized_and_the_connection_goes_on():
    async def test(h: Harness) -> None:
        agent = h.dealer(b"agent-big")
        agent.send(b"x" * 5000)
        agent.send(b"small")
        await h.until(lambda: len(h.received) == 2)
        (_, (big,)), (_, small) = h.received
        assert isinstance(big, OversizedMessage) and len(big) > 1024 and small == [b"small"]
    run(test, max_frame_bytes=1024)


def test_a_peer_that_does_not_speak_zmtp_is_dropped_and_others_are_served():
    async def test(h: Harness) -> None:
        host, port = h.router.address.removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\n" + b"x" * 100)
        assert len(await asyncio.wait_for(reader.read(1000), 5)) > 0  # our greeting
        assert await asyncio.wait_for(reader.read(1000), 5) == b""  # then the door
        writer.close()
        pusher = h.dealer(kind=zmq.PUSH)  # a socket type a ROUTER cannot talk to
        pusher.send(b"pushed", zmq.NOBLOCK)
        agent = h.dealer(b"agent-ok")
        agent.send(b"fine")
        await h.until(lambda: h.received)
        await asyncio.sleep(0.1)
        assert h.received == [(b"agent-ok", [b"fine"])]
    run(test)


def test_unread_says_whether_data_waits_for_a_loop_that_is_behind():
    async def test(h: Harness) -> None:
        agent = h.dealer(b"agent-u")
        agent.send(b"one")
        await h.until(lambda: h.received)
        assert not h.router.unread()
        agent.send(b"two")
        deadline = time.monotonic() + 5.0
        while not h.router.unread():  # the loop is blocked on purpose: the message waits in the kernel
            assert time.monotonic() < deadline, "the message never arrived"
            time.sleep(0.01)  # noqa: ASYNC251
        assert len(h.received) == 1
        await h.until(lambda: len(h.received) == 2)
        assert not h.router.unread()
    run(test)


def test_sends_fail_once_a_connection_holds_more_than_the_high_water_mark_unsent():
    async def test(h: Harness) -> None:
        agent = h.dealer(b"agent-slow", RCVHWM=1, RCVBUF=4096)
        agent.send(b"join")
        await h.until(lambda: h.received)
        payload = b"p" * 65536
        sent = 0
        while h.router.send(b"agent-slow", payload):
            sent += 1
            assert sent < 2_000, "the high-water mark never held"
            if sent % 16 == 0:
                await asyncio.sleep(0)  # let the loop write what the kernel takes
        assert sent >= 1
    run(test, send_high_water_bytes=256 * 1024)


def test_an_ipc_address_is_served_and_its_socket_file_removed_on_close(tmp_path):
    address = f"ipc://{tmp_path / 'ranks.sock'}"

    async def test(h: Harness) -> None:
        agent = h.dealer(b"agent-ipc")
        agent.send(b"over ipc")
        await h.until(lambda: h.received)
        assert h.received == [(b"agent-ipc", [b"over ipc"])]
    run(test, address)
    assert not (tmp_path / "ranks.sock").exists()


def test_a_taken_port_is_an_os_error_at_construction():
    holder = socketlib.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        with pytest.raises(OSError):
            LoopRouter(f"tcp://127.0.0.1:{holder.getsockname()[1]}", lambda i, p: None, lambda: None,
                       max_frame_bytes=1024, send_high_water_bytes=1024)
    finally:
        holder.close()


@pytest.mark.parametrize("address, served", [
    ("tcp://127.0.0.1:5561", True), ("tcp://[::1]:5561", True), ("tcp://*:5561", True),
    ("tcp://localhost:5561", True), ("ipc:///tmp/ranks.sock", True),
    ("tcp://eth0:5561", False), ("tcp://127.0.0.1:*", False), ("inproc://ranks", False), ("ipc://", False),
])
def test_which_addresses_the_loop_serves(address, served):
    assert serves(address) is served


def test_the_daemon_serves_its_routers_on_the_loop_where_it_can_and_as_told():
    assert DaemonConfig().routers_on_loop
    assert DaemonConfig(rank_address="ipc:///tmp/ranks.sock").routers_on_loop
    assert not DaemonConfig(transport="zmq").routers_on_loop
    assert not DaemonConfig(client_address="inproc://clients").routers_on_loop
    with pytest.raises(ConfigError, match="transport = \"loop\" serves"):
        DaemonConfig.from_mapping({"transport": "loop", "rank_address": "inproc://ranks"})
    with pytest.raises(ConfigError, match="transport"):
        DaemonConfig.from_mapping({"transport": "libuv"})


def test_a_peer_that_never_finishes_its_handshake_is_dropped_at_the_timeout():
    async def test(h: Harness) -> None:
        host, port = h.router.address.removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(zmtp.greeting()[:10])  # a signature, then silence
        started = time.monotonic()
        while await asyncio.wait_for(reader.read(4096), 5):
            pass
        assert 0.2 <= time.monotonic() - started < 5
        writer.close()
        agent = h.dealer(b"agent-after")  # a peer that completes it is served
        agent.send(b"fine")
        await h.until(lambda: h.received)
        await asyncio.sleep(0.4)
        assert h.router.peers == frozenset({b"agent-after"})
    run(test, handshake_timeout_s=0.3)


def test_a_message_of_too_many_parts_drops_its_peer():
    async def test(h: Harness) -> None:
        agent = h.dealer(b"agent-parts")
        agent.send(b"hello")
        await h.until(lambda: h.received)
        agent.send_multipart([b"p"] * 17)
        await h.until(lambda: not h.router.peers)
        await h.until(lambda: h.router.peers)  # libzmq reconnects
        agent.send_multipart([b"p"] * 16)  # a message within the limit goes through
        await h.until(lambda: len(h.received) == 2)
        assert h.received == [(b"agent-parts", [b"hello"]), (b"agent-parts", [b"p"] * 16)]
    run(test)

"""SocketPump: every message read, multipart messages whole, in order, in bounded passes."""

from __future__ import annotations

import asyncio

import zmq

from controlplane.socket_pump import SocketPump


def test_a_pump_reads_every_message_whole_and_in_order_across_passes() -> None:
    async def main() -> None:
        context = zmq.Context.instance()
        reader, writer = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        reader.bind("inproc://pump-test")
        writer.connect("inproc://pump-test")
        got: list[list[bytes]] = []
        pump = SocketPump(reader, lambda frames: got.append([frame.bytes for frame in frames]),
                          max_per_pass=7)
        try:
            for n in range(20):  # waiting before the pump starts
                writer.send_multipart([b"a%d" % n, b"b%d" % n] if n % 3 else [b"a%d" % n])
            pump.start()
            for _ in range(200):
                if len(got) == 20:
                    break
                await asyncio.sleep(0.01)
            for n in range(20, 40):  # arriving while it runs, sent from the loop
                writer.send_multipart([b"a%d" % n, b"b%d" % n, b"c%d" % n])
                if n % 4 == 0:
                    await asyncio.sleep(0)
            for _ in range(200):
                if len(got) == 40:
                    break
                await asyncio.sleep(0.01)
        finally:
            pump.stop()
            reader.close(linger=0)
            writer.close(linger=0)
        expected = [[b"a%d" % n, b"b%d" % n] if n % 3 else [b"a%d" % n] for n in range(20)]
        expected += [[b"a%d" % n, b"b%d" % n, b"c%d" % n] for n in range(20, 40)]
        assert got == expected

    asyncio.run(asyncio.wait_for(main(), 15.0))

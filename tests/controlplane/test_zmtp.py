"""ZMTP 3.1 framing (NULL mechanism): greetings, commands, metadata, the frame reader."""

from __future__ import annotations

import pytest

from controlplane import zmtp


def test_the_greeting_is_64_octets_of_zmtp_3_1_with_null_security():
    greeting = zmtp.greeting()
    assert len(greeting) == zmtp.GREETING_SIZE
    assert greeting[0] == 0xFF and greeting[9] == 0x7F and tuple(greeting[10:12]) == (3, 1)
    assert greeting[12:32] == b"NULL" + b"\x00" * 16
    assert zmtp.check_greeting(greeting) == (3, 1)


@pytest.mark.parametrize("mutate, message", [
    (lambda g: b"\x00" + g[1:], "not a ZMTP greeting"),
    (lambda g: g[:10] + b"\x02\x00" + g[12:], "version 3 or later"),
    (lambda g: g[:12] + b"CURVE".ljust(20, b"\x00") + g[32:], "only NULL"),
    (lambda g: g[:40], "not a ZMTP greeting"),
])
def test_a_greeting_other_than_zmtp_3_with_null_is_refused(mutate, message):
    with pytest.raises(zmtp.ProtocolError, match=message):
        zmtp.check_greeting(mutate(zmtp.greeting()))


def test_frames_are_short_up_to_255_octets_and_long_beyond():
    assert zmtp.frame(b"abc") == b"\x00\x03abc"
    assert zmtp.frame(b"abc", more=True) == b"\x01\x03abc"
    long = zmtp.frame(b"x" * 256)
    assert long[0] == zmtp.LONG and long[1:9] == (256).to_bytes(8, "big") and long[9:] == b"x" * 256
    assert zmtp.command(b"PING", b"\x00\x0actx")[0] == zmtp.COMMAND


def test_ready_metadata_reads_back_with_names_case_folded():
    (flags, body), = feed_all(zmtp.ready(b"DEALER", {b"Identity": b"agent-1", b"X-Long": b"v" * 300}))
    name, data = zmtp.split_command(body)
    assert flags & zmtp.COMMAND and name == b"READY"
    assert zmtp.parse_metadata(data) == {"socket-type": b"DEALER", "identity": b"agent-1", "x-long": b"v" * 300}


def test_truncated_metadata_and_commands_are_protocol_errors():
    with pytest.raises(zmtp.ProtocolError):
        zmtp.parse_metadata(b"\x0bSocket-Type\x00\x00\x00\x09DEAL")
    with pytest.raises(zmtp.ProtocolError):
        zmtp.split_command(b"\x05REA")
    with pytest.raises(zmtp.ProtocolError):
        zmtp.split_command(b"")


def test_a_pong_echoes_the_pings_context_without_its_ttl():
    (_, body), = feed_all(zmtp.pong(b"\x00\x1eabc"))
    assert zmtp.split_command(body) == (b"PONG", b"abc")


def feed_all(data: bytes, reader: zmtp.FrameReader | None = None, step: int | None = None):
    reader = reader or zmtp.FrameReader(max_body=1 << 20)
    out = []
    for at in range(0, len(data), step or len(data) or 1):
        reader.feed(data[at:at + (step or len(data))])
        out += [(flags, None if body is None else bytes(body)) for flags, body in reader.frames()]
    return out


@pytest.mark.parametrize("step", [1, 2, 7, 300, None])
def test_the_reader_cuts_frames_however_the_stream_is_split(step):
    stream = zmtp.frame(b"a", more=True) + zmtp.frame(b"b" * 1000) + zmtp.frame(b"") + zmtp.command(b"PING")
    assert feed_all(stream, step=step) == [
        (zmtp.MORE, b"a"), (zmtp.LONG, b"b" * 1000), (0, b""), (zmtp.COMMAND, b"\x04PING")]


@pytest.mark.parametrize("step", [3, 64, None])
def test_a_frame_over_the_limit_is_skipped_as_it_streams_and_reported_once(step):
    reader = zmtp.FrameReader(max_body=100)
    stream = zmtp.frame(b"x" * 5000, more=True) + zmtp.frame(b"after")
    assert feed_all(stream, reader, step) == [(zmtp.MORE | zmtp.LONG, None), (0, b"after")]
    assert len(reader._buffer) == 0  # nothing of the skipped frame was held


def test_take_returns_raw_octets_once_they_are_all_there():
    reader = zmtp.FrameReader(max_body=10)
    reader.feed(b"x" * 63)
    assert reader.take(64) is None
    reader.feed(b"y" + zmtp.frame(b"m"))
    assert reader.take(64) == b"x" * 63 + b"y"
    assert [(f, bytes(b)) for f, b in reader.frames()] == [(0, b"m")]

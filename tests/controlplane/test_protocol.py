"""Wire protocol: every message round-trips; random and mutated frames only ever raise FrameError."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane import protocol as p

SAMPLES_BY_CHANNEL = {
    p.client_request_channel: [
        p.Submit("req-1", p.Prompt(text="Hello"), p.SamplingParams(max_new_tokens=8, temperature=0.0, stop=["\n"]),
                 p.SloSpec(slo_class="tight"), deadline_s=2.5, stream=False),
        p.Submit("req-2", p.Prompt(token_ids=[1, 2, 3]), slo=p.SloSpec(ttft_ms=500, tpot_ms=50)),
        p.Submit("req-3", p.Prompt(text="def f():"), slo=p.SloSpec(e2e_ms=20_000)),
        p.Submit("req-4", p.Prompt(text="def g():"), slo=p.SloSpec("code", ttft_ms=800, e2e_ms=9_000.5)),
        p.Cancel("req-1"),
        p.Ping(42),
        p.StatusRequest(),
        p.DrainRank("rank-0"),
        p.DrainRank("rank-1", drain=False),
    ],
    p.client_reply_channel: [
        p.Dispatched("req-1", "rank-0", 7),
        p.Chunk("req-1", [5, 6], "ab", 2),
        p.Finish("req-1", p.FinishReason.LENGTH, 3, 8, 0.12, 0.5, "text", [1, 2]),
        p.Reject("req-1", p.RejectReason.NO_BUDGET, "none covers", 0.25, True),
        p.Reject("req-2", p.RejectReason.INTERNAL, "the daemon failed handling Output; see its log"),
        p.Pong(42, "d1", True),
        p.StatusReply("d1", "pab", 3.0, False, 1, 0, [
            p.RankStatus("rank-0", "agent-0", 9, 100.0, 200.0, 1, 2, 3000, 1, 0.1, False, 10, 0, 4),
            p.RankStatus("rank-1", "agent-0", 9, None, None, 0, 0, 0, 0, None, True, 0, 0, 0, draining=True),
        ], {"dispatched": 4}),
        p.DrainReply("rank-0", True, True, 3),
        p.DrainReply("nope", False),
    ],
    p.agent_message_channel: [
        p.Hello("agent-0", "rank-0", 123456789, protocol=p.PROTOCOL_VERSION),
        p.Goodbye("rank-0", 123456789),
        p.Draining("rank-0", 123456789),
        p.Heartbeat("agent-0"),
        p.Output("rank-0", 3, "req-1", [9], " tok", 4),
        p.Done("rank-0", 3, "req-1", p.FinishReason.STOP, 10, 4, 0.1, 0.9),
        p.Done("rank-0", 3, "req-2", p.FinishReason.ERROR, error="bad slo", invalid=True),
    ],
    p.daemon_to_agent_channel: [
        p.Welcome("rank-0", 3, "d1", "tcp://127.0.0.1:5562", 0.5),
        p.Dispatch("req-1", "rank-0", 3, 11, p.Prompt(token_ids=[1]), p.SamplingParams(ignore_eos=True),
                   p.SloSpec(slo_class="relaxed"), False),
        p.Dispatch("req-3", "rank-0", 3, 12, p.Prompt(text="x"), slo=p.SloSpec(e2e_ms=20_000, ttft_ms=900)),
        p.Abort("rank-0", 3, "req-1"),
        p.Fenced("rank-0", 2, "older epoch"),
    ],
    p.report_channel: [
        p.Report("rank-0", 3, 1, 1234.5, 2, 3, 4096, 80_000, 11, 0.02, 5.5),
        p.Report("rank-0", 3, 2, 1234.5, 2, 3, 4096, 80_000, 11, 0.02, 5.6,
                 {"interactive": p.ClassBudget(0.5, -300.0), "relaxed": p.ClassBudget(8.0, 9000.0)}),
    ],
}
ALL_SAMPLES = [(factory, message) for factory, messages in SAMPLES_BY_CHANNEL.items() for message in messages]


@pytest.mark.parametrize(("factory", "message"), ALL_SAMPLES, ids=lambda x: type(x).__name__)
def test_every_message_round_trips(factory, message):
    assert factory().decode(p.encode(message)) == message


@pytest.mark.parametrize(("factory", "message"), ALL_SAMPLES, ids=lambda x: type(x).__name__)
def test_messages_are_refused_on_other_channels(factory, message):
    for other in SAMPLES_BY_CHANNEL:
        if other is factory or type(message) in {type(m) for m in SAMPLES_BY_CHANNEL[other]}:
            continue
        with pytest.raises(p.FrameError):
            other().decode(p.encode(message))


def test_slo_spec_is_the_custom_params_shape():
    assert p.SloSpec(slo_class="tight").as_custom_params() == {"class": "tight"}
    assert p.SloSpec(ttft_ms=100, tpot_ms=20).as_custom_params() == {"ttft_ms": 100.0, "tpot_ms": 20.0}
    assert p.SloSpec("code", e2e_ms=20_000).as_custom_params() == {"class": "code", "e2e_ms": 20_000.0}


def test_an_e2e_spec_resolves_at_the_ranks_as_the_daemon_routes_it():
    from sglang_ext.policy.slo import E2E_TTFT_SHARE, Slo, SloCatalog

    assert p.E2E_TTFT_SHARE == E2E_TTFT_SHARE
    catalog = SloCatalog.single(Slo(0.5, 0.05), "chat")
    for spec in (p.SloSpec(e2e_ms=20_000), p.SloSpec(e2e_ms=9_000, ttft_ms=700),
                 p.SloSpec(ttft_ms=300, tpot_ms=20)):
        resolved = catalog.resolve(spec.as_custom_params())
        assert resolved.ttft_s * 1e3 == pytest.approx(spec.first_token_ms)
    assert p.SloSpec(slo_class="chat").first_token_ms is None  # its class's
    assert p.SloSpec(slo_class="chat", tpot_ms=20).first_token_ms is None


@pytest.mark.parametrize(("slo", "detail"), [
    ({"e2e_ms": 20_000, "tpot_ms": 50},
     "give e2e_ms (an end-to-end target) or tpot_ms, not both - at `$.slo`"),
    ({"class": "code", "e2e_ms": 20_000, "tpot_ms": 50}, "not both"),
    ({"e2e_ms": 2_000, "ttft_ms": 2_000}, "ttft_ms 2000 must be below e2e_ms 2000 - at `$.slo`"),
    ({"e2e_ms": 0}, "Expected `float` > 0.0 - at `$.slo.e2e_ms`"),
    ({"e2e_ms": "20s"}, "Expected `float | null`, got `str` - at `$.slo.e2e_ms`"),
])
def test_a_contradictory_or_malformed_e2e_spec_is_an_invalid_frame_saying_why(slo, detail):
    frame = p.HEADER + msgspec.msgpack.encode(
        {"type": "submit", "request_id": "r", "prompt": {"text": "x"}, "slo": slo})
    with pytest.raises(p.FrameError) as refused:
        p.client_request_channel().decode(frame)
    assert refused.value.kind == "invalid" and detail in refused.value.detail
    dispatch = p.HEADER + msgspec.msgpack.encode({"type": "dispatch", "request_id": "r", "rank": "a",
                                                  "epoch": 1, "dispatch_seq": 1, "prompt": {"text": "x"},
                                                  "slo": slo})
    with pytest.raises(p.FrameError, match="invalid"):
        p.daemon_to_agent_channel().decode(dispatch)


def test_a_contradictory_e2e_spec_is_refused_where_it_is_built():
    with pytest.raises(ValueError, match="or tpot_ms, not both"):
        p.SloSpec(e2e_ms=20_000, tpot_ms=50)
    with pytest.raises(msgspec.ValidationError, match="ttft_ms 500 must be below e2e_ms 400"):
        msgspec.convert({"e2e_ms": 400, "ttft_ms": 500}, p.SloSpec)


@pytest.mark.parametrize(
    ("frame", "kind"),
    [
        (b"", "truncated"),
        (b"\xfb\x01", "truncated"),
        (b"\x00\x01\x80", "bad_magic"),
        (b"\xfb\x07\x80", "wrong_version"),
        (b"\xfb\x01\xc1", "malformed"),
        (p.HEADER + msgspec.msgpack.encode({"type": "nope"}), "invalid"),
        (p.HEADER + msgspec.msgpack.encode({"type": "cancel"}), "invalid"),
        (p.HEADER + msgspec.msgpack.encode({"type": "cancel", "request_id": "x", "extra": 1}), "invalid"),
        (p.HEADER + msgspec.msgpack.encode({"type": "cancel", "request_id": "has space"}), "invalid"),
        (p.encode(p.Submit("r", p.Prompt())), "invalid"),
        (p.encode(p.Submit("r", p.Prompt(text="x", token_ids=[1]))), "invalid"),
        (p.encode(p.Submit("r", p.Prompt(token_ids=[]))), "invalid"),
        (p.HEADER + msgspec.msgpack.encode({"type": "submit", "request_id": "r", "prompt": {"token_ids": [-1]}}), "invalid"),
        (p.HEADER + msgspec.msgpack.encode({"type": "submit", "request_id": "r", "prompt": {"text": "x"},
                                            "sampling": {"max_new_tokens": 0}}), "invalid"),
    ],
)
def test_bad_frames_are_refused_with_their_kind(frame, kind):
    with pytest.raises(p.FrameError) as refused:
        p.client_request_channel().decode(frame)
    assert refused.value.kind == kind


def test_frame_size_is_checked_before_decoding():
    channel = p.client_request_channel(max_frame_bytes=1024)
    big = p.encode(p.Submit("r", p.Prompt(text="x" * 2000)))
    with pytest.raises(p.FrameError) as refused:
        channel.decode(big)
    assert refused.value.kind == "oversized"
    with pytest.raises(p.FrameError) as refused:
        p.report_channel().decode(p.HEADER + b"\x00" * (64 * 1024))
    assert refused.value.kind == "oversized"


def test_epoch_and_seq_bounds():
    for frame in (
        p.HEADER + msgspec.msgpack.encode({"type": "hello", "agent": "a", "rank": "r", "epoch": 0}),
        p.HEADER + msgspec.msgpack.encode({"type": "hello", "agent": "a", "rank": "r", "epoch": 2**64 - 1}),
    ):
        with pytest.raises(p.FrameError):
            p.agent_message_channel().decode(frame)


def test_ids_a_rank_echoes_are_length_checked_only_and_client_ids_keep_their_pattern():
    odd = "a b\x01"  # fails the id pattern: no client or rank can have it
    output = p.Output(rank=odd, epoch=1, request_id=odd)
    report = p.Report(rank=odd, epoch=1, seq=1, pab_tokens=0.0, running=0, waiting=0, total_tokens=0,
                      free_kv_tokens=0, echoed_dispatch_seq=0, step_time_s=0.0, sent_at=0.0)
    assert p.agent_message_channel().decode(p.encode(p.RankOutputs([output]))).items == [output]
    assert p.report_channel().decode(p.encode(report)) == report
    for bad in ("", "x" * 129):
        with pytest.raises(p.FrameError, match="invalid"):
            p.agent_message_channel().decode(p.encode(p.Output(rank="r", epoch=1, request_id=bad)))
    with pytest.raises(p.FrameError, match="invalid"):
        p.client_request_channel().decode(p.encode(p.Submit(odd, p.Prompt(text="hi"))))
    with pytest.raises(p.FrameError, match="invalid"):
        p.agent_message_channel().decode(p.encode(p.Hello(agent=odd, rank="r", epoch=1)))


CHANNELS = list(SAMPLES_BY_CHANNEL)
ENCODED = [p.encode(m) for _, m in ALL_SAMPLES]


@settings(max_examples=400, deadline=None)
@given(frame=st.binary(max_size=512), channel=st.sampled_from(CHANNELS))
def test_random_frames_never_escape_as_other_errors(frame, channel):
    try:
        channel().decode(frame)
    except p.FrameError:
        pass


@settings(max_examples=600, deadline=None)
@given(data=st.data(), channel=st.sampled_from(CHANNELS))
def test_mutated_valid_frames_decode_or_raise_frame_error(data, channel):
    frame = bytearray(data.draw(st.sampled_from(ENCODED)))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(frame) - 1))
        operation = data.draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
        if operation == "flip":
            frame[position] ^= 1 << data.draw(st.integers(0, 7))
        elif operation == "delete" and len(frame) > 1:
            del frame[position]
        elif operation == "insert":
            frame.insert(position, data.draw(st.integers(0, 255)))
        else:
            del frame[position:]
        if not frame:
            break
    try:
        message = channel().decode(bytes(frame))
    except p.FrameError:
        return
    assert isinstance(message, msgspec.Struct)


@settings(max_examples=200, deadline=None)
@given(payload=st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
))
def test_random_msgpack_documents_are_refused_cleanly(payload):
    try:
        frame = p.HEADER + msgspec.msgpack.encode(payload)
    except (OverflowError, msgspec.EncodeError):
        return
    for channel in CHANNELS:
        try:
            channel().decode(frame)
        except p.FrameError:
            pass


class HelloV1(msgspec.Struct, frozen=True, tag="hello"):
    """A Hello as a protocol-version-1 agent encodes it."""

    agent: str
    rank: str
    epoch: int


class ReportV1(msgspec.Struct, frozen=True, tag="report"):
    rank: str
    epoch: int
    seq: int
    pab_tokens: float
    running: int
    waiting: int
    total_tokens: int
    free_kv_tokens: int
    echoed_dispatch_seq: int
    step_time_s: float
    sent_at: float


def test_a_version_1_hello_reads_as_version_1_and_is_refused_naming_both_versions():
    hello = p.agent_message_channel().decode(p.encode(HelloV1("agent-0", "rank-0", 5)))
    assert hello.protocol == p.LEGACY_PROTOCOL_VERSION == 1
    refusal = p.protocol_refusal(hello.protocol)
    assert refusal.startswith(p.UNSUPPORTED_PROTOCOL)
    assert "protocol version 1" in refusal and f"version {p.PROTOCOL_VERSION}" in refusal
    assert "upgrade the rank agent" in refusal
    assert "upgrade the daemon" in p.protocol_refusal(p.PROTOCOL_VERSION + 1)
    assert p.protocol_refusal(p.PROTOCOL_VERSION) is None


def test_a_version_1_report_decodes_without_class_budgets():
    report = p.report_channel().decode(p.encode(ReportV1("r", 1, 1, 10.0, 0, 0, 0, 0, 0, 0.0, 1.0)))
    assert report.class_budgets == {}


@pytest.mark.parametrize("budget", [
    {"": {"ttft_s": 1.0, "tokens": 1.0}},
    {"x" * 65: {"ttft_s": 1.0, "tokens": 1.0}},
    {"a": {"ttft_s": 0.0, "tokens": 1.0}},
    {"a": {"ttft_s": 1.0, "tokens": float("nan")}},
    {"a": {"ttft_s": 1.0, "tokens": float("inf")}},
    {"a": {"ttft_s": 1.0}},
    {f"c{i}": {"ttft_s": 1.0, "tokens": 1.0} for i in range(p.MAX_SLO_CLASSES + 1)},
])
def test_bad_class_budgets_are_refused_as_invalid(budget):
    fields = dict(rank="r", epoch=1, seq=1, pab_tokens=1.0, running=0, waiting=0, total_tokens=0,
                  free_kv_tokens=0, echoed_dispatch_seq=0, step_time_s=0.0, sent_at=0.0,
                  class_budgets=budget, type="report")
    with pytest.raises(p.FrameError) as error:
        p.report_channel().decode(p.HEADER + msgspec.msgpack.encode(fields))
    assert error.value.kind == "invalid"


def test_class_budgets_are_clamped_and_bounded_for_a_report():
    budgets = p.pack_class_budgets({"a": float("inf"), "b": float("nan"), "c": -1e12, "d": 12.5},
                              {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0})
    assert budgets == {"a": p.ClassBudget(1.0, p.BUDGET_LIMIT), "b": p.ClassBudget(2.0, 0.0),
                       "c": p.ClassBudget(3.0, -p.BUDGET_LIMIT), "d": p.ClassBudget(4.0, 12.5)}
    with pytest.raises(ValueError, match="at most 64"):
        p.pack_class_budgets({f"c{i}": 1.0 for i in range(65)}, {f"c{i}": 1.0 for i in range(65)})
    with pytest.raises(ValueError, match="1-64 characters"):
        p.pack_class_budgets({"x" * 65: 1.0}, {"x" * 65: 1.0})


def test_a_version_2_agent_is_refused_now_that_a_dispatch_may_carry_an_e2e_slo():
    refusal = p.protocol_refusal(2)
    assert "protocol version 2" in refusal and "end-to-end SLOs in Dispatch since 3" in refusal
    assert "upgrade the rank agent" in refusal


def test_a_version_3_agent_is_refused_now_that_a_dispatch_may_carry_chat_messages():
    assert p.CHAT_PROTOCOL_VERSION == 4 < p.PROTOCOL_VERSION
    refusal = p.protocol_refusal(3)
    assert "protocol version 3" in refusal and "chat messages since 4" in refusal
    chat = p.Dispatch("r1", "rank-0", 1, 1, p.Prompt(messages=[p.ChatMessage("user", "hi")]))
    with pytest.raises(msgspec.ValidationError, match="unknown field `messages`"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(chat.prompt), type=_VersionThreePrompt)


class _VersionThreePrompt(msgspec.Struct, forbid_unknown_fields=True):
    """What a version-3 peer decodes a Dispatch's prompt into."""

    text: str | None = None
    token_ids: list[int] | None = None


def test_a_version_4_agent_is_refused_now_that_output_is_coalesced():
    assert p.PROTOCOL_VERSION == p.BATCH_PROTOCOL_VERSION == 5
    refusal = p.protocol_refusal(4)
    assert refusal.startswith(p.UNSUPPORTED_PROTOCOL)
    assert "protocol version 4" in refusal and "coalesced outputs since 5" in refusal
    assert "upgrade the rank agent" in refusal
    assert "upgrade the daemon" in p.protocol_refusal(6)
    assert p.protocol_refusal(5) is None


def test_a_client_that_does_not_state_version_5_is_refused_by_name():
    assert p.Submit("r", p.Prompt(text="x")).protocol == 0  # what an older SDK's Submit decodes to
    refusal = p.client_refusal(0)
    assert refusal.startswith(p.UNSUPPORTED_PROTOCOL)
    assert "version 4 or older" in refusal and "upgrade the client" in refusal
    assert "version 5" in refusal
    assert p.client_refusal(p.PROTOCOL_VERSION) is None


def test_batches_round_trip_in_order_and_unbatch():
    items = [p.Output("r0", 1, f"q{i % 3}", [i], str(i), i // 3 + 1, 7) for i in range(30)]
    items.append(p.Done("r0", 1, "q0", p.FinishReason.LENGTH, 3, 10, dispatch_seq=7))
    outputs = p.RankOutputs(items)
    decoded = p.agent_message_channel().decode(p.encode(outputs))
    assert decoded == outputs and p.unbatched(decoded) == items
    replies = p.Replies([p.Dispatched("q0", "r0", 7), p.Chunk("q0", [1], "a", 1),
                         p.Finish("q0", p.FinishReason.STOP)])
    assert p.client_reply_channel().decode(p.encode(replies)) == replies
    assert p.unbatched(p.Pong(1, "d")) == [p.Pong(1, "d")]


def test_a_batch_carries_only_its_channels_per_request_messages():
    with pytest.raises(p.FrameError) as error:
        p.agent_message_channel().decode(p.encode(p.RankOutputs([p.Heartbeat("a")])))
    assert error.value.kind == "invalid"
    with pytest.raises(p.FrameError):
        p.client_reply_channel().decode(p.encode(p.Replies([p.Pong(1, "d")])))
    too_many = p.RankOutputs([p.Output("r0", 1, "q", [1])] * (p.MAX_BATCH_ITEMS + 1))
    with pytest.raises(p.FrameError):
        p.agent_message_channel().decode(p.encode(too_many))

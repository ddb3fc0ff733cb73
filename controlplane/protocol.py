"""The control plane's wire protocol: msgspec Structs, msgpack on the wire, never pickle.

Every frame is ``MAGIC + SCHEMA_VERSION + msgpack(message)``; the message is one member
of a tagged union (the ``type`` field names it). :func:`decode` checks the frame's size,
magic and version *before* msgpack decoding, then decodes with a typed decoder for the
channel, so a peer can only ever produce one of the messages that channel allows.
Anything else raises :class:`FrameError` with a short machine-readable ``kind``; the
caller drops the frame, counts it and logs it with the peer.

Sockets (the daemon binds all three, loopback by default)::

    clients  --DEALER-->  ROUTER  client_address   ClientRequest  /  ClientReply
    agents   --DEALER-->  ROUTER  rank_address     AgentMessage   /  DaemonToAgent
    ranks    --PUSH---->  PULL    report_address   Report (one-way; loss tolerated)

A rank agent serves one or more ranks (one rank = one data-parallel scheduler). It says
:class:`Hello` for each rank with a fresh ``epoch``; the daemon fences messages from any
older epoch. Reports are per rank, numbered by ``seq`` per (rank, epoch), and echo the
highest dispatch sequence they account for, which travels with each request (SGLang:
``custom_params["_fairbatching_dispatch_seq"]``).

Schema version 1 grows by additions only (new messages, new fields with defaults, new
enum values); ``SCHEMA_VERSION`` changes only for a change an older peer would misread.
A peer drops, counts and logs a frame it cannot decode, so an older one receiving an
addition is no worse off than before it existed.

An addition that changes what the daemon does with a rank raises ``PROTOCOL_VERSION``,
which an agent states in every :class:`Hello`; the daemon fences a ``Hello`` of any
other version with a detail naming both (:func:`protocol_refusal`), so a rank it would
misread never joins. A ``Hello`` without the field is version 1.

- 1: the first release.
- 2: :attr:`Report.class_budgets`, the PAB of each SLO class; the daemon routes a
  request on its class's budget. A version-1 rank reports none, and routing its
  requests on the default class's budget would silently ignore their classes.
- 3: :attr:`SloSpec.e2e_ms`, the end-to-end SLO, in ``Dispatch``. A version-2 agent
  cannot decode a ``Dispatch`` that carries it and would drop it: the request would
  hang at the daemon until its deadline.
- 4: :attr:`Prompt.messages`, a chat conversation the rank renders with its model's
  chat template, in ``Submit`` and ``Dispatch``. A version-3 agent would drop such a
  ``Dispatch``, so it is fenced; a version-3 daemon would drop such a ``Submit``
  unanswered, so the daemon states its version in :attr:`Pong.protocol` (absent: 3 or
  older) and the SDK refuses to send messages to an older one.
- 5: coalesced output. A rank agent sends every request's new output of an engine step
  (or of one event-loop pass) as one :class:`RankOutputs`, and the daemon answers each
  client with one :class:`Replies` per pass of its sockets. A request that is not
  streamed crosses once, in its ``Done``/``Finish``. A version-4 SDK would drop a
  ``Replies`` and wait for its answer forever, so a client states its version in
  :attr:`Submit.protocol` (absent: 4 or older) and the daemon refuses an older one with
  ``Reject invalid`` naming both versions (:func:`client_refusal`); the SDK refuses a
  daemon whose ``Pong.protocol`` is older than 5.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Annotated, Final, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

MAGIC: Final = b"\xfb"
SCHEMA_VERSION: Final = 1
HEADER: Final = MAGIC + bytes([SCHEMA_VERSION])
MAGIC_BYTE: Final = MAGIC[0]
PROTOCOL_VERSION: Final = 5
CHAT_PROTOCOL_VERSION: Final = 4  # the first version with ``Prompt.messages``
BATCH_PROTOCOL_VERSION: Final = 5  # the first version with RankOutputs and Replies
MAX_BATCH_ITEMS: Final = 4096  # messages in one RankOutputs or Replies
LEGACY_PROTOCOL_VERSION: Final = 1  # a Hello without ``protocol``
UNSUPPORTED_PROTOCOL: Final = "unsupported protocol"  # Fenced.detail prefix
MAX_SLO_CLASSES: Final = 64
MAX_SLO_CLASS_NAME: Final = 64
BUDGET_LIMIT: Final = float(2**31 - 1)  # reported budgets are clamped to +-this
DEFAULT_MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
#: an e2e SLO's first-token share of ``e2e_ms`` when it states no ``ttft_ms``: the ranks'
#: (``sglang_ext.policy.slo.E2E_TTFT_SHARE``; a test keeps the two equal)
E2E_TTFT_SHARE: Final = 0.25
MAX_CHAT_MESSAGES: Final = 1024

RequestId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]
RankId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[\x21-\x7e]+$")]
#: The ids a rank echoes in every step's output and every report: only ever looked up among
#: the ids the daemon checked as they came in (a Submit's, a Hello's), so an id that fails
#: the pattern matches nothing and is dropped as unknown; only their length is checked (the
#: pattern, once per item, was two thirds of the cost of decoding a step's output).
EchoedRequestId = Annotated[str, Meta(min_length=1, max_length=128)]
EchoedRankId = Annotated[str, Meta(min_length=1, max_length=64)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
SloClassName = Annotated[str, Meta(min_length=1, max_length=MAX_SLO_CLASS_NAME)]
BudgetTokens = Annotated[float, Meta(ge=-BUDGET_LIMIT, le=BUDGET_LIMIT)]
Epoch = Annotated[int, Meta(ge=1, le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]


class RejectReason(enum.StrEnum):
    NO_BUDGET = "no_budget"  # no rank's PAB covers the prompt (retry after retry_after_s)
    OVERLOADED = "overloaded"  # in-flight or queue limits reached (retry after retry_after_s)
    INVALID = "invalid"  # the request itself is wrong; never retry
    DUPLICATE = "duplicate"  # this request id is already in flight
    RANK_LOST = "rank_lost"  # the rank serving it went away
    NO_RANKS = "no_ranks"  # no rank is registered at all
    DEADLINE = "deadline"  # the client's deadline passed before the request finished
    QUEUE_TIMEOUT = "queue_timeout"  # waited in the admission queue past its TTL
    SHUTTING_DOWN = "shutting_down"  # the daemon is draining
    INTERNAL = "internal"  # the daemon failed handling a message about it (a bug; retry before output)


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


# ------------------------------------------------------------------ request content
class SamplingParams(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] = 128
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    min_new_tokens: NonNegInt = 0
    stop: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=16)] = []
    ignore_eos: bool = False
    seed: int | None = None


class SloSpec(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A class name (resolved by the rank's SLO catalog), explicit targets, or a class
    with targets overridden. ``e2e_ms`` (protocol version 3) makes the SLO end-to-end:
    the last token within ``e2e_ms`` of arrival, the first within ``ttft_ms`` if given;
    it excludes ``tpot_ms``. Contradictory targets are refused when the spec is built or
    decoded (a ``ValueError``; in a frame, ``FrameError`` ``invalid``)."""

    slo_class: Annotated[str, Meta(max_length=64)] | None = msgspec.field(default=None, name="class")
    ttft_ms: Annotated[float, Meta(gt=0.0)] | None = None
    tpot_ms: Annotated[float, Meta(gt=0.0)] | None = None
    e2e_ms: Annotated[float, Meta(gt=0.0)] | None = None

    def __post_init__(self) -> None:
        if self.e2e_ms is None:
            return
        if self.tpot_ms is not None:
            raise ValueError("give e2e_ms (an end-to-end target) or tpot_ms, not both")
        if self.ttft_ms is not None and self.ttft_ms >= self.e2e_ms:
            raise ValueError(f"ttft_ms {self.ttft_ms:g} must be below e2e_ms {self.e2e_ms:g}")

    @property
    def first_token_ms(self) -> float | None:
        """The first-token target the spec itself sets: ``ttft_ms``, else an ``e2e_ms``'s
        share (``E2E_TTFT_SHARE``, as the ranks resolve it); None: its class's."""
        if self.ttft_ms is not None or self.e2e_ms is None:
            return self.ttft_ms
        return E2E_TTFT_SHARE * self.e2e_ms

    def as_custom_params(self) -> dict[str, object]:
        """The shape SGLang's extension and the simulator read from ``custom_params["slo"]``."""
        return msgspec.to_builtins(self)


def as_slo_spec(value: SloSpec | str | Mapping[str, object] | None) -> SloSpec | None:
    """A request's SLO as a client states it: a spec, a class name, or the spec's mapping
    (``{"class": ..., "ttft_ms": ...}``); None: the rank's default class. The SDK and the
    HTTP gateway both read it here. Raises ``msgspec.ValidationError`` or ``ValueError``."""
    if value is None or isinstance(value, SloSpec):
        return value
    if isinstance(value, str):
        return SloSpec(slo_class=value)
    return msgspec.convert(value, SloSpec)


class ChatMessage(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One turn of a conversation (protocol version 4), text only."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Meta(max_length=1_000_000)]
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None


class Prompt(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Exactly one of ``text``, ``token_ids`` and ``messages``. ``messages`` (protocol
    version 4) is a conversation the rank renders with its model's chat template, adding
    the assistant's turn header, as an OpenAI chat completion does."""

    text: Annotated[str, Meta(max_length=1_000_000)] | None = None
    token_ids: list[TokenId] | None = None
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_CHAT_MESSAGES)] | None = None

    def validate(self) -> None:
        given = sum(form is not None for form in (self.text, self.token_ids, self.messages))
        if given != 1:
            raise ValueError("a prompt needs exactly one of text, token_ids and messages")
        if self.token_ids is not None and not self.token_ids:
            raise ValueError("token_ids must not be empty")
        if self.text is not None and not self.text:
            raise ValueError("text must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")


# ------------------------------------------------------------------ client -> daemon
class Submit(Struct, frozen=True, tag="submit", forbid_unknown_fields=True, omit_defaults=True):
    request_id: RequestId
    prompt: Prompt
    sampling: SamplingParams = SamplingParams()
    slo: SloSpec | None = None
    deadline_s: Annotated[float, Meta(gt=0.0)] | None = None  # relative to the daemon's receipt
    stream: bool = True
    protocol: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0  # the client's; 0: 4 or older


def client_refusal(version: int) -> str | None:
    """Why the daemon refuses a ``Submit`` from a client of protocol ``version`` (0: a
    client too old to state it); None when it can read the daemon's replies."""
    if version >= BATCH_PROTOCOL_VERSION:
        return None
    stated = f"version {version}" if version else "version 4 or older"
    return (f"{UNSUPPORTED_PROTOCOL}: the client speaks protocol {stated}, the daemon speaks "
            f"version {PROTOCOL_VERSION} (replies coalesced into one message per pass since 5); "
            "upgrade the client (the controlplane SDK)")


class Cancel(Struct, frozen=True, tag="cancel", forbid_unknown_fields=True):
    request_id: RequestId


class Ping(Struct, frozen=True, tag="ping", forbid_unknown_fields=True):
    nonce: int = 0


class StatusRequest(Struct, frozen=True, tag="status_request", forbid_unknown_fields=True):
    pass


class DrainRank(Struct, frozen=True, tag="drain_rank", forbid_unknown_fields=True):
    """Operator: stop (``drain``) or resume dispatching to ``rank``; its in-flight
    requests run on. Answered by :class:`DrainReply`."""

    rank: RankId
    drain: bool = True


ClientRequest = Submit | Cancel | Ping | StatusRequest | DrainRank


# ------------------------------------------------------------------ daemon -> client
class Dispatched(Struct, frozen=True, tag="dispatched"):
    request_id: str
    rank: str
    dispatch_seq: int


class Chunk(Struct, frozen=True, tag="chunk", omit_defaults=True):
    """New output since the previous chunk; ``completion_tokens`` is the running total."""

    request_id: str
    token_ids: list[int] = []
    text: str = ""
    completion_tokens: int = 0


class Finish(Struct, frozen=True, tag="finish", omit_defaults=True):
    request_id: str
    reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # measured at the rank, receipt to first token
    latency_s: float | None = None
    text: str = ""  # the whole output, for non-streamed requests
    token_ids: list[int] = []
    error: str = ""


class Reject(Struct, frozen=True, tag="reject", omit_defaults=True):
    """The request is over and was not served (or stopped before finishing).

    ``retryable`` says whether resubmitting the same request id can succeed: true for
    no budget, overloaded, queue timeout and no ranks, and for rank lost and internal
    before any output was streamed.
    """

    request_id: str
    reason: RejectReason
    detail: str = ""
    retry_after_s: float | None = None
    retryable: bool = False


class Pong(Struct, frozen=True, tag="pong"):
    """``protocol``: the daemon's ``PROTOCOL_VERSION``; 0 from a daemon older than 4,
    which did not send it."""

    nonce: int
    daemon_id: str
    draining: bool = False
    protocol: int = 0


class RankStatus(Struct, frozen=True):
    rank: str
    agent: str
    epoch: int
    pab_tokens: float | None  # effective (reported minus unreported debits); None = unknown
    reported_pab_tokens: float | None
    running: int
    waiting: int
    free_kv_tokens: int
    in_flight: int
    report_age_s: float | None
    stale: bool
    reports: int
    seq_gaps: int
    dispatched: int
    draining: bool = False  # no new dispatches; its in-flight requests run on
    class_budgets: dict[str, float] = {}  # effective, per SLO class (protocol version 2)


class StatusReply(Struct, frozen=True, tag="status"):
    daemon_id: str
    policy: str
    uptime_s: float
    draining: bool
    in_flight: int
    queued: int
    ranks: list[RankStatus]
    counters: dict[str, int]


class DrainReply(Struct, frozen=True, tag="drain_reply"):
    """``known`` is false when the daemon has no rank of that name (nothing changed)."""

    rank: str
    known: bool
    draining: bool = False
    in_flight: int = 0


RequestReply = Dispatched | Chunk | Finish | Reject


class Replies(Struct, frozen=True, tag="replies"):
    """Protocol version 5: the replies about a client's requests from one pass of the
    daemon's sockets, in the order they were made (per request, the order it sent them)."""

    items: Annotated[list[RequestReply], Meta(max_length=MAX_BATCH_ITEMS)]


ClientReply = Dispatched | Chunk | Finish | Reject | Pong | StatusReply | DrainReply | Replies


# ------------------------------------------------------------------ agent <-> daemon
class Hello(Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """A rank joins (or rejoins with a new epoch). ``agent`` must equal the sender's
    ZMQ routing id; every later message about ``rank`` must come from it."""

    agent: RankId
    rank: RankId
    epoch: Epoch
    protocol: Annotated[int, Meta(ge=1, le=2**31 - 1)] = LEGACY_PROTOCOL_VERSION


def protocol_refusal(version: int) -> str | None:
    """Why the daemon fences a ``Hello`` of protocol ``version``; None when it speaks it."""
    if version == PROTOCOL_VERSION:
        return None
    upgrade = "the rank agent" if version < PROTOCOL_VERSION else "the daemon"
    return (f"{UNSUPPORTED_PROTOCOL}: the rank speaks protocol version {version}, the daemon "
            f"speaks version {PROTOCOL_VERSION} (per-SLO-class budgets in Report since 2, "
            f"end-to-end SLOs in Dispatch since 3, chat messages since 4, coalesced outputs "
            f"since 5); upgrade {upgrade}")


def unbatched(message: Struct) -> list[Struct]:
    """The messages a :class:`Replies` or :class:`RankOutputs` carries, in order; any other
    message alone."""
    if isinstance(message, (Replies, RankOutputs)):
        return list(message.items)
    return [message]


class Goodbye(Struct, frozen=True, tag="goodbye", forbid_unknown_fields=True):
    """The rank leaves on purpose; its in-flight requests fail with rank lost."""

    rank: RankId
    epoch: Epoch


class Draining(Struct, frozen=True, tag="draining", forbid_unknown_fields=True):
    """The rank is shutting down gracefully: dispatch nothing new to it; its in-flight
    requests finish as usual, then ``Goodbye``. Sent again after every ``Welcome``."""

    rank: RankId
    epoch: Epoch


class Heartbeat(Struct, frozen=True, tag="heartbeat", forbid_unknown_fields=True):
    agent: RankId


class Output(Struct, frozen=True, tag="output", forbid_unknown_fields=True, omit_defaults=True):
    """Rank -> daemon: new output of a dispatched request (same meaning as :class:`Chunk`)."""

    rank: EchoedRankId
    epoch: Epoch
    request_id: EchoedRequestId
    token_ids: list[int] = []
    text: str = ""
    completion_tokens: NonNegInt = 0
    dispatch_seq: NonNegInt = 0  # the Dispatch this answers (0: not given)


class Done(Struct, frozen=True, tag="done", forbid_unknown_fields=True, omit_defaults=True):
    """Rank -> daemon: the request is over at the rank (finished, cancelled or failed)."""

    rank: EchoedRankId
    epoch: Epoch
    request_id: EchoedRequestId
    reason: FinishReason
    prompt_tokens: NonNegInt = 0
    completion_tokens: NonNegInt = 0
    ttft_s: NonNegFloat | None = None
    latency_s: NonNegFloat | None = None
    text: str = ""
    token_ids: list[int] = []
    error: Annotated[str, Meta(max_length=4096)] = ""
    invalid: bool = False  # the rank refused the request as malformed (client error)
    no_budget: bool = False  # the rank's admission control refused it before it cost anything
    dispatch_seq: NonNegInt = 0  # the Dispatch this answers (0: not given)


class RankOutputs(Struct, frozen=True, tag="outputs", forbid_unknown_fields=True):
    """Protocol version 5: the new output of every request an agent's ranks served in one
    engine step (or one event-loop pass), in order; the daemon handles each item as if it
    came alone. Control messages (Hello, Heartbeat, Draining, Goodbye) never wait in one."""

    items: Annotated[list[Output | Done], Meta(max_length=MAX_BATCH_ITEMS)]


AgentMessage = Hello | Goodbye | Draining | Heartbeat | Output | Done | RankOutputs


class Welcome(Struct, frozen=True, tag="welcome"):
    rank: str
    epoch: int
    daemon_id: str
    report_address: str
    heartbeat_interval_s: float


class Dispatch(Struct, frozen=True, tag="dispatch", omit_defaults=True):
    request_id: str
    rank: str
    epoch: int
    dispatch_seq: int
    prompt: Prompt
    sampling: SamplingParams = SamplingParams()
    slo: SloSpec | None = None
    stream: bool = True


class Abort(Struct, frozen=True, tag="abort"):
    rank: str
    epoch: int
    request_id: str


class Fenced(Struct, frozen=True, tag="fenced"):
    """The daemon refuses this (rank, epoch): a newer epoch holds the rank, or it left."""

    rank: str
    epoch: int
    detail: str


DaemonToAgent = Welcome | Dispatch | Abort | Fenced


# ------------------------------------------------------------------ rank -> daemon reports
class ClassBudget(Struct, frozen=True, forbid_unknown_fields=True):
    """One SLO class's admission budget at a rank: prompt tokens a new request of the
    class may bring and still meet its TTFT (``ttft_s``, the class's target, lets the
    daemon map a request with an explicit TTFT onto a class)."""

    ttft_s: Annotated[float, Meta(gt=0.0)]
    tokens: BudgetTokens


class Report(Struct, frozen=True, tag="report", forbid_unknown_fields=True):
    """One rank's load. ``seq`` counts reports per (rank, epoch) from 1;
    ``echoed_dispatch_seq`` is the highest dispatch sequence this report accounts for.
    ``pab_tokens`` is the default SLO class's budget; ``class_budgets`` (protocol
    version 2) each class's, by class name."""

    rank: EchoedRankId
    epoch: Epoch
    seq: Annotated[int, Meta(ge=1)]
    pab_tokens: float
    running: NonNegInt
    waiting: NonNegInt
    total_tokens: NonNegInt  # tokens held by running + waiting requests (SGLang's total_tokens load)
    free_kv_tokens: NonNegInt
    echoed_dispatch_seq: NonNegInt
    step_time_s: NonNegFloat
    sent_at: float  # the reporter's monotonic clock (ordering/age diagnostics only)
    class_budgets: Annotated[dict[SloClassName, ClassBudget], Meta(max_length=MAX_SLO_CLASSES)] = {}


def budget_tokens(tokens: float) -> float:
    """A budget as a report carries it: clamped to +-``BUDGET_LIMIT``, NaN as 0."""
    if math.isnan(tokens):
        return 0.0
    return max(-BUDGET_LIMIT, min(BUDGET_LIMIT, float(tokens)))


def pack_class_budgets(budgets: Mapping[str, float],
                       ttfts: Mapping[str, float]) -> dict[str, ClassBudget]:
    """A report's ``class_budgets`` from each SLO class's budget and TTFT target (seconds).
    Raises ValueError for more classes, or longer names, than a report may carry."""
    if len(budgets) > MAX_SLO_CLASSES:
        raise ValueError(f"{len(budgets)} SLO classes; a report carries at most {MAX_SLO_CLASSES}")
    out = {}
    for name, tokens in budgets.items():
        if not 1 <= len(name) <= MAX_SLO_CLASS_NAME:
            raise ValueError(f"SLO class name {name[:80]!r} must be 1-64 characters to be reported")
        out[name] = ClassBudget(ttft_s=ttfts[name], tokens=budget_tokens(tokens))
    return out


# ------------------------------------------------------------------ framing
class FrameError(ValueError):
    """A frame was refused; ``kind`` is one of oversized, truncated, bad_magic,
    wrong_version, malformed, invalid."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


_ENCODER = msgspec.msgpack.Encoder()


def encode(message: Struct) -> bytes:
    return HEADER + _ENCODER.encode(message)


T = TypeVar("T")


class Channel(Generic[T]):
    """A typed decoder for one direction of one socket."""

    def __init__(self, name: str, message_type: object, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.name = name
        self.max_frame_bytes = max_frame_bytes
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def decode(self, frame: bytes | memoryview) -> T:
        size = len(frame)
        if size > self.max_frame_bytes:
            raise FrameError("oversized", f"{size} bytes > {self.max_frame_bytes}")
        if size < len(HEADER) + 1:
            raise FrameError("truncated", f"{size} bytes")
        view = memoryview(frame)  # read in place: no copy of the header, one view
        if view[0] != MAGIC_BYTE:
            raise FrameError("bad_magic", f"first byte {view[0]:#04x}")
        if view[1] != SCHEMA_VERSION:
            raise FrameError("wrong_version", f"schema {view[1]}, expected {SCHEMA_VERSION}")
        try:
            message = self._decoder.decode(view[len(HEADER):])
        except msgspec.ValidationError as error:
            raise FrameError("invalid", str(error)) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as error:
            # msgspec raises UnicodeDecodeError itself for invalid UTF-8 in a str
            raise FrameError("malformed", str(error)) from None
        if isinstance(message, (Submit, Dispatch)):
            try:
                message.prompt.validate()
            except ValueError as error:
                raise FrameError("invalid", str(error)) from None
        return message


def client_request_channel(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Channel[ClientRequest]:
    return Channel("client", ClientRequest, max_frame_bytes)


def client_reply_channel(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Channel[ClientReply]:
    return Channel("client_reply", ClientReply, max_frame_bytes)


def agent_message_channel(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Channel[AgentMessage]:
    return Channel("agent", AgentMessage, max_frame_bytes)


def daemon_to_agent_channel(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Channel[DaemonToAgent]:
    return Channel("daemon_to_agent", DaemonToAgent, max_frame_bytes)


def report_channel(max_frame_bytes: int = 64 * 1024) -> Channel[Report]:
    return Channel("report", Report, max_frame_bytes)


def retryable(reason: RejectReason) -> bool:
    """Whether a request refused for ``reason`` may be resubmitted; rank lost and internal
    only before any output reached the client (the daemon's ``Reject.retryable`` says)."""
    return reason in {RejectReason.NO_BUDGET, RejectReason.OVERLOADED, RejectReason.QUEUE_TIMEOUT,
                      RejectReason.RANK_LOST, RejectReason.NO_RANKS, RejectReason.INTERNAL}

"""What the SDK raises. Every error is a :class:`ControlPlaneError`; a request the daemon
refused (or stopped) is a :class:`RequestRejected` subclass named after its reason."""

from __future__ import annotations

from controlplane.protocol import Reject, RejectReason


class ControlPlaneError(Exception):
    def __init__(self, message: str, *, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class DaemonUnavailable(ControlPlaneError):
    """No reply in time, or the daemon restarted and the request's fate there is unknown
    (output had already been received, so resubmitting it would not be safe)."""


class Cancelled(ControlPlaneError):
    """The request was cancelled (by :meth:`cancel`, the client closing, or another party)."""


class RequestFailed(ControlPlaneError):
    """The rank finished the request with an error."""


class SlowConsumer(ControlPlaneError):
    """A stream's consumer fell so far behind that its buffer filled; the request was cancelled."""


class RequestRejected(ControlPlaneError):
    def __init__(self, reason: RejectReason, detail: str = "", retry_after_s: float | None = None,
                 retryable: bool = False, *, request_id: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason), request_id=request_id)
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s
        self.retryable = retryable


class NoBudget(RequestRejected):
    pass


class Overloaded(RequestRejected):
    pass


class InvalidRequest(RequestRejected, ValueError):
    pass


class DuplicateRequest(RequestRejected):
    pass


class RankLost(RequestRejected):
    pass


class NoRanks(RequestRejected):
    pass


class DeadlineExceeded(RequestRejected, TimeoutError):
    pass


class QueueTimeout(RequestRejected):
    pass


class ShuttingDown(RequestRejected):
    pass


class InternalError(RequestRejected):
    """The daemon failed while handling a message about the request (a bug there, in its
    log and its ``internal_errors`` counter). The SDK retries it only before any output."""


_BY_REASON: dict[RejectReason, type[RequestRejected]] = {
    RejectReason.NO_BUDGET: NoBudget,
    RejectReason.OVERLOADED: Overloaded,
    RejectReason.INVALID: InvalidRequest,
    RejectReason.DUPLICATE: DuplicateRequest,
    RejectReason.RANK_LOST: RankLost,
    RejectReason.NO_RANKS: NoRanks,
    RejectReason.DEADLINE: DeadlineExceeded,
    RejectReason.QUEUE_TIMEOUT: QueueTimeout,
    RejectReason.SHUTTING_DOWN: ShuttingDown,
    RejectReason.INTERNAL: InternalError,
}


def rejected(reason: RejectReason, detail: str = "", retry_after_s: float | None = None,
             retryable: bool = False, *, request_id: str = "") -> RequestRejected:
    """The exception for ``reason`` (its subclass)."""
    return _BY_REASON.get(reason, RequestRejected)(reason, detail, retry_after_s, retryable,
                                                   request_id=request_id)


def from_reject(reject: Reject) -> RequestRejected:
    return rejected(reject.reason, reject.detail, reject.retry_after_s, reject.retryable,
                    request_id=reject.request_id)

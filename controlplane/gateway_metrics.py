"""The gateway's ``GET /metrics``: the daemon's status (one status request per scrape) and
the gateway's own responses and requests held, in Prometheus' text format (0.0.4)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from controlplane.protocol import StatusReply


class HeldRequests(Protocol):
    """What the gateway holds (:class:`controlplane.gateway.InFlight`)."""

    count: int  # completion requests held now
    limit: int  # the most it holds (--max-in-flight)
    refused: int  # requests refused (429) at the limit


def prometheus_text(status: StatusReply, responses: Mapping[int, int],
                    in_flight: HeldRequests | None = None) -> str:
    """The daemon's status and the gateway's responses (and requests held) in Prometheus'
    text format."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

    prefix = "fairbatching_controlplane"
    family(f"{prefix}_in_flight", "gauge", "Requests dispatched and not finished.", [("", status.in_flight)])
    family(f"{prefix}_queued", "gauge", "Requests in the admission queue.", [("", status.queued)])
    family(f"{prefix}_draining", "gauge", "1 while the daemon drains.", [("", float(status.draining))])
    family(f"{prefix}_uptime_seconds", "gauge", "Seconds since the daemon started.", [("", status.uptime_s)])
    family(f"{prefix}_events_total", "counter", "The daemon's event counters.",
           [(_labels(event=name), value) for name, value in sorted(status.counters.items())])
    per_rank = (
        ("rank_pab_tokens", "Effective prefill admission budget (reported minus unreported debits).",
         lambda r: r.pab_tokens),
        ("rank_running", "Requests running, as last reported.", lambda r: r.running),
        ("rank_waiting", "Requests waiting, as last reported.", lambda r: r.waiting),
        ("rank_in_flight", "Requests the daemon has in flight on the rank.", lambda r: r.in_flight),
        ("rank_free_kv_tokens", "Free KV-cache tokens, as last reported.", lambda r: r.free_kv_tokens),
        ("rank_report_age_seconds", "Age of the last report.", lambda r: r.report_age_s),
        ("rank_stale", "1 when the rank's reports are stale (load unknown).", lambda r: float(r.stale)),
        ("rank_draining", "1 when the rank gets no new requests.", lambda r: float(r.draining)),
        ("rank_report_seq_gaps", "Reports missed, by sequence number.", lambda r: r.seq_gaps),
    )
    for name, help_text, value_of in per_rank:
        samples = [(_labels(rank=r.rank), value_of(r)) for r in status.ranks if value_of(r) is not None]
        family(f"{prefix}_{name}", "gauge", help_text, samples)
    family("fairbatching_gateway_responses_total", "counter", "HTTP responses of this gateway by status.",
           [(_labels(status=str(code)), count) for code, count in sorted(responses.items())])
    if in_flight is not None:
        family("fairbatching_gateway_in_flight", "gauge", "Completion requests this gateway holds.",
               [("", in_flight.count)])
        family("fairbatching_gateway_in_flight_limit", "gauge", "Its limit (--max-in-flight).",
               [("", in_flight.limit)])
        family("fairbatching_gateway_refused_total", "counter",
               "Requests refused (429) because the gateway held its limit.", [("", in_flight.refused)])
    return "\n".join(lines) + "\n"


def _labels(**labels: str) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{key}="{escape(value)}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value))

"""Which ranks exist, which epoch each is in, and how fresh its reports are. Pure.

A rank is owned by one agent (a ZMQ routing id) and one epoch at a time. A newer epoch
replaces the rank (it restarted); messages from an older one are fenced. Reports are
ordered per (rank, epoch) by their ``seq``: an old or repeated one is dropped, a jump
counts the missed reports as gaps. A *draining* rank gets no new dispatches until it
leaves or a newer epoch replaces it (or an operator resumes it). A rank is *fresh* while its last report is younger
than the staleness limit; a stale rank's load is unknown, never zero.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from controlplane.protocol import Report


class HelloOutcome(enum.Enum):
    JOINED = "joined"
    REJOINED = "rejoined"  # the same epoch again: a reconnecting agent or a restarted daemon
    RESTARTED = "restarted"  # a newer epoch replaced the rank
    FENCED = "fenced"  # an older epoch


class ReportOutcome(enum.Enum):
    APPLIED = "applied"
    OUT_OF_ORDER = "out_of_order"
    FENCED = "fenced"  # another epoch than the rank's current one
    UNKNOWN_RANK = "unknown_rank"


@dataclass(slots=True)
class RankState:
    rank: str
    agent: bytes
    epoch: int
    joined_at: float
    report: Report | None = None
    report_at: float | None = None
    reports: int = 0
    seq_gaps: int = 0
    dispatched: int = 0
    in_flight: set[str] = field(default_factory=set)
    unreachable: bool = False  # a send to its agent failed; cleared by the agent's next message
    draining: bool = False  # no new dispatches (the rank or an operator asked); kept across re-Hellos

    def report_age(self, now: float) -> float | None:
        return None if self.report_at is None else now - self.report_at

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return (not self.unreachable and self.report_at is not None
                and now - self.report_at <= stale_after_s)


@dataclass(frozen=True, slots=True)
class Departure:
    """A rank that left (or was replaced); its in-flight requests must fail."""

    rank: str
    epoch: int
    in_flight: frozenset[str]


class RankRegistry:
    def __init__(self) -> None:
        self._ranks: dict[str, RankState] = {}
        self._agent_seen: dict[bytes, float] = {}

    def __contains__(self, rank: str) -> bool:
        return rank in self._ranks

    def __len__(self) -> int:
        return len(self._ranks)

    def get(self, rank: str) -> RankState | None:
        return self._ranks.get(rank)

    def ranks(self) -> list[RankState]:
        return [self._ranks[name] for name in sorted(self._ranks)]

    def knows_agent(self, agent: bytes) -> bool:
        return agent in self._agent_seen

    def hello(self, agent: bytes, rank: str, epoch: int, now: float) -> tuple[HelloOutcome, Departure | None]:
        held = self._ranks.get(rank)
        if held is not None and epoch < held.epoch:
            return HelloOutcome.FENCED, None
        self._agent_seen[agent] = now
        if held is not None and epoch == held.epoch:
            held.agent = agent
            held.unreachable = False
            return HelloOutcome.REJOINED, None
        departure = self._remove(rank) if held is not None else None
        self._ranks[rank] = RankState(rank, agent, epoch, joined_at=now)
        return (HelloOutcome.RESTARTED if departure else HelloOutcome.JOINED), departure

    def owns(self, agent: bytes, rank: str, epoch: int) -> bool:
        """Whether ``agent`` speaks for ``rank``'s current epoch."""
        held = self._ranks.get(rank)
        return held is not None and held.epoch == epoch and held.agent == agent

    def seen(self, agent: bytes, now: float) -> None:
        if agent in self._agent_seen:
            self._agent_seen[agent] = now
            for state in self._ranks.values():
                if state.agent == agent:
                    state.unreachable = False

    def leave(self, rank: str) -> Departure | None:
        departure = self._remove(rank)
        if departure is not None:
            self._forget_idle_agents()
        return departure

    def lost_agents(self, now: float, lost_after_s: float) -> list[Departure]:
        """Remove every rank whose agent has been silent for longer than ``lost_after_s``."""
        silent = {agent for agent, seen in self._agent_seen.items() if now - seen > lost_after_s}
        if not silent:
            return []
        departures = [self._remove(state.rank) for state in list(self._ranks.values())
                      if state.agent in silent]
        for agent in silent:
            del self._agent_seen[agent]
        return [d for d in departures if d is not None]

    def report(self, report: Report, now: float) -> tuple[ReportOutcome, int]:
        """Apply ``report``; returns the outcome and how many reports it shows were missed."""
        held = self._ranks.get(report.rank)
        if held is None:
            return ReportOutcome.UNKNOWN_RANK, 0
        if report.epoch != held.epoch:
            return ReportOutcome.FENCED, 0
        last_seq = held.report.seq if held.report is not None else 0
        if report.seq <= last_seq:
            return ReportOutcome.OUT_OF_ORDER, 0
        gaps = report.seq - last_seq - 1 if held.report is not None else 0
        held.report = report
        held.report_at = now
        held.reports += 1
        held.seq_gaps += gaps
        return ReportOutcome.APPLIED, gaps

    def mark_unreachable(self, agent: bytes) -> None:
        for state in self._ranks.values():
            if state.agent == agent:
                state.unreachable = True

    def _remove(self, rank: str) -> Departure | None:
        state = self._ranks.pop(rank, None)
        if state is None:
            return None
        return Departure(rank, state.epoch, frozenset(state.in_flight))

    def _forget_idle_agents(self) -> None:
        owning = {state.agent for state in self._ranks.values()}
        for agent in [a for a in self._agent_seen if a not in owning]:
            del self._agent_seen[agent]

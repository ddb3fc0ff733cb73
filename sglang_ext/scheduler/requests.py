"""What the policy sees of an SGLang ``Req``: an SLO record attached once per request
and a frozen view built each step."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from sglang_ext.dp_pab import dispatch_seq_of
from sglang_ext.policy.slo import Slo, SloCatalog, SloError
from sglang_ext.policy.view import RequestView

logger = logging.getLogger(__name__)

RECORD_ATTR = "_fairbatching_record"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    slo: Slo
    arrival: float  # scheduler receive time, time.perf_counter seconds
    arrival_seq: int
    dispatch_seq: int | None  # stamped by the DP controller's pab method


class RequestRecords:
    """Attaches a :class:`RequestRecord` to each ``Req`` the first time it is seen."""

    def __init__(self, catalog: SloCatalog) -> None:
        self.catalog = catalog
        self._sequence = itertools.count()
        self.highest_dispatch_seq = 0

    def of(self, req: Any) -> RequestRecord:
        record = getattr(req, RECORD_ATTR, None)
        if record is None:
            record = self._attach(req)
        return record

    def _attach(self, req: Any) -> RequestRecord:
        custom_params = getattr(req.sampling_params, "custom_params", None)
        try:
            slo = self.catalog.resolve_custom_params(custom_params)
        except SloError as exc:
            # The HTTP front door rejects malformed SLOs with a 400; a request that
            # reached the scheduler another way falls back rather than crash it.
            logger.warning("request %s: %s; using the default SLO class", req.rid, exc)
            slo = self.catalog.default
        dispatch_seq = dispatch_seq_of(req)
        if dispatch_seq is not None:
            self.highest_dispatch_seq = max(self.highest_dispatch_seq, dispatch_seq)
        arrival = req.time_stats.scheduler_recv_time
        record = RequestRecord(slo, arrival, next(self._sequence), dispatch_seq)
        setattr(req, RECORD_ATTR, record)
        return record

    def decode_view(self, req: Any, in_flight: bool) -> RequestView:
        """A decoding request. Under the overlap scheduler ``in_flight`` requests have a
        token being computed that ``output_ids`` does not show yet: the next token this
        step can produce is one further on."""
        record = self.of(req)
        produced = len(req.output_ids) + (1 if in_flight else 0)
        return RequestView(
            req_id=req.rid,
            arrival=record.arrival,
            slo=record.slo,
            next_output_index=produced,
            pending_prefill=0,
            context=len(req.origin_input_ids) + produced,
            prompt_tokens=len(req.origin_input_ids),
            arrival_seq=record.arrival_seq,
            first_token_time=req.time_stats.prefill_finished_time or None,
        )

    def prefill_view(self, req: Any) -> RequestView:
        """A request with prompt (or, after retraction, recompute) tokens not in KV yet."""
        record = self.of(req)
        total = len(req.origin_input_ids) + len(req.output_ids)
        cached = min(req.prefix_len, total - 1)
        return RequestView(
            req_id=req.rid,
            arrival=record.arrival,
            slo=record.slo,
            next_output_index=len(req.output_ids),
            pending_prefill=total - cached,
            context=cached,
            prompt_tokens=len(req.origin_input_ids),
            arrival_seq=record.arrival_seq,
            first_token_time=req.time_stats.prefill_finished_time or None,
        )


def must_decode(req: Any) -> bool:
    """Requests that are never parked: ones being finished or aborted, and ones whose
    sampling state lives in the batch (penalties, grammars, logprobs, custom logit
    processors), which a rebuilt batch would not carry over."""
    if req.finished() or req.to_finish is not None:
        return True
    params = req.sampling_params
    return bool(
        req.return_logprob
        or req.grammar is not None
        or params.frequency_penalty
        or params.presence_penalty
        or params.repetition_penalty != 1.0
        or params.min_new_tokens
        or getattr(params, "custom_logit_processor", None)
    )

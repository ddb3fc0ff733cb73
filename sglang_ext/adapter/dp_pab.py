"""`--load-balance-method pab` for SGLang's DP controller, installed through HookRegistry.

Needs patches/0001-dp-load-balance-pab.patch (the method name, the LoadSnapshot fields
and the controller's two hook points). What the hooks do:

- Scheduler side: ``Scheduler.init_load_inquirer`` is followed by swapping the load
  inquirer for a subclass whose ``get_loads()`` fills ``fairbatching_pab_tokens`` and
  ``fairbatching_dispatch_seq`` from ``scheduler.fairbatching`` (an object with
  ``pab_tokens`` and ``highest_dispatch_seq``; absent: the fields stay None / 0), and
  ``fairbatching_admission`` from its ``class_budgets`` (per SLO class; read by
  :mod:`sglang_ext.adapter.admission.budget_gate` and by this method; empty or absent: None) with
  ``fairbatching_admission_echo`` (per admission gate, the highest admission number
  those budgets count; the gate's debits end on it). A
  scheduler of a server run with ``--load-balance-method pab`` computes them whatever
  its admission mode (``sglang_ext.adapter.scheduler.hooks.attach``).
- Controller side: ``init_pab_dispatch`` creates the PAB ledger, waits for every rank's
  first load snapshot and fails start-up if a rank reports no PAB (FairBatching off
  there): a user who asked for pab gets pab or an error, never a silent round robin.
  ``DPBudget.update_budget`` also feeds each fresh snapshot to the ledger, and
  ``pab_scheduler`` routes with ``choose_rank`` on the ledger's effective budgets of
  the request's SLO class, debits the prompt (from every class alike) and stamps the
  dispatch sequence number into the request's ``sampling_params.custom_params`` (read
  back with ``dispatch_seq_of``).
- The request's class is its ``custom_params["slo"]``, as the control-plane daemon
  reads a ``Submit``'s SLO (``controlplane.balancer.routing_class``): the class it
  names; with an explicit ``ttft_ms`` or ``e2e_ms``, the class of the config's catalog
  with the largest TTFT not above the request's first-token budget (``e2e_ms`` without
  ``ttft_ms``: its share of ``e2e_ms``; below every class, the smallest); neither, or
  an SLO the catalog refuses: the default class's PAB (``fairbatching_pab_tokens``). So
  is a rank that publishes no budget for the class.
- A rank that has not reported yet (start-up timed out, or an elastic rank that just
  joined) makes that request go round robin, with one warning per rank.
- Requests pinned with ``routed_dp_rank`` go where they are pinned, undebited and
  unstamped; the rank's next snapshot counts them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any

from controlplane.balancer import routing_class
from controlplane.ledger import PabLedger, RankBudget
from sglang_ext.adapter.custom_params import custom_param, set_custom_param
from sglang_ext.adapter.dp_balance import choose_rank
from sglang_ext.policy.slo import SloCatalog, SloError, slo_spec_of

logger = logging.getLogger(__name__)

DISPATCH_SEQ_KEY = "_fairbatching_dispatch_seq"
STARTUP_SNAPSHOT_TIMEOUT_S = 30.0
_STARTUP_POLL_S = 0.05

_DPC = "sglang.srt.managers.data_parallel_controller"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_installed = False


def install_dp_pab_hooks(catalog: SloCatalog | None = None) -> None:
    """Register the hooks (idempotent); ``load_plugins()`` applies them afterwards.
    ``catalog``: the SLO classes requests name (None: every request routes on the
    default class's PAB)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def init_dispatch(controller: Any) -> None:
        init_pab_dispatch(controller, catalog)

    HookRegistry.register(
        f"{_DPC}.DataParallelController.init_pab_dispatch", init_dispatch, HookType.REPLACE
    )
    HookRegistry.register(
        f"{_DPC}.DataParallelController.pab_scheduler", pab_scheduler, HookType.REPLACE
    )
    HookRegistry.register(f"{_DPC}.DPBudget.update_budget", after_update_budget, HookType.AFTER)
    HookRegistry.register(
        f"{_SCHEDULER}.init_load_inquirer", after_init_load_inquirer, HookType.AFTER
    )
    _installed = True


# --- requests -----------------------------------------------------------------------


def dispatch_seq_of(req: Any) -> int | None:
    """The dispatch sequence number the controller stamped on ``req`` (a ``Req`` or a
    tokenized request), or None when it was not dispatched by the pab method."""
    seq = custom_param(req, DISPATCH_SEQ_KEY)
    if isinstance(seq, bool) or not isinstance(seq, int):
        return None
    return seq


def stamp_dispatch_seq(req: Any, seq: int | None) -> None:
    """Set (or, with None, remove) the stamp; the dict is copied, never shared."""
    set_custom_param(req.sampling_params, DISPATCH_SEQ_KEY, seq)


def request_class(catalog: SloCatalog | None, req: Any) -> str | None:
    """The SLO class whose budget routes ``req`` (None: the default class's PAB)."""
    if catalog is None:
        return None
    custom_params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    try:
        spec = slo_spec_of(custom_params)
        slo = catalog.resolve(spec)
    except SloError:
        return None  # the front door refuses it; routing is no place to fail it
    if not spec:
        return None
    # an explicit ttft_ms or e2e_ms sets the first-token budget (e2e_ms alone: its share)
    explicit = "ttft_ms" in spec or "e2e_ms" in spec
    ttfts = {name: class_slo.ttft_s for name, class_slo in catalog.classes.items()}
    return routing_class(ttfts, spec.get("class"), slo.ttft_s if explicit else None)


def prompt_tokens_of(req: Any) -> int:
    for tokens in (getattr(req, "input_ids", None), getattr(req, "input_embeds", None)):
        if tokens is not None:
            return len(tokens)
    return 0


# --- scheduler side -----------------------------------------------------------------


def snapshot_has_pab_fields() -> bool:
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    return "fairbatching_pab_tokens" in LoadSnapshot.__struct_fields__


def fill_snapshot(snapshot: Any, fairbatching: Any) -> None:
    """Copy a scheduler's FairBatching state into its LoadSnapshot (None: leave as is)."""
    if fairbatching is None:
        return
    pab = fairbatching.pab_tokens
    if isinstance(pab, float):
        if not math.isfinite(pab):
            raise ValueError(f"FairBatching PAB must be finite, got {pab}")
        pab = math.floor(pab)
    snapshot.fairbatching_pab_tokens = int(pab)
    snapshot.fairbatching_dispatch_seq = int(fairbatching.highest_dispatch_seq)
    budgets = getattr(fairbatching, "class_budgets", None)
    if budgets and "fairbatching_admission" in type(snapshot).__struct_fields__:
        snapshot.fairbatching_admission = dict(budgets)
        echo = getattr(fairbatching, "admission_echo", None)
        if echo:
            snapshot.fairbatching_admission_echo = dict(echo)


@functools.cache
def _fairbatching_inquirer_class() -> type:
    from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer

    @dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
    class FairBatchingLoadInquirer(SchedulerLoadInquirer):
        get_fairbatching: Any  # () -> the scheduler's `fairbatching` object or None

        def get_loads(self):
            # Explicit base call: zero-argument super() breaks in slotted dataclasses.
            snapshot = SchedulerLoadInquirer.get_loads(self)
            fill_snapshot(snapshot, self.get_fairbatching())
            return snapshot

    return FairBatchingLoadInquirer


def after_init_load_inquirer(_result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    if not snapshot_has_pab_fields():
        logger.warning(
            "FairBatching: LoadSnapshot has no PAB fields (run scripts/patches.sh apply); "
            "this rank's load snapshots will not carry its PAB"
        )
        return
    inquirer = scheduler.load_inquirer
    cls = _fairbatching_inquirer_class()
    if isinstance(inquirer, cls):
        return
    fields = {f.name: getattr(inquirer, f.name) for f in dataclasses.fields(inquirer)}
    scheduler.load_inquirer = cls(
        **fields, get_fairbatching=lambda: getattr(scheduler, "fairbatching", None)
    )


# --- controller side ----------------------------------------------------------------


@dataclasses.dataclass
class ControllerPab:
    """The pab method's state on a DataParallelController (``controller.fairbatching_pab``)."""

    ledger: PabLedger = dataclasses.field(default_factory=PabLedger)
    warned_ranks: set[int] = dataclasses.field(default_factory=set)
    catalog: SloCatalog | None = None

    def warn_once(self, rank: int, message: str) -> None:
        if rank not in self.warned_ranks:
            self.warned_ranks.add(rank)
            logger.warning(message)


def rank_budget_of(snapshot: Any) -> RankBudget | None:
    """A snapshot's PAB report, or None when it carries none."""
    pab = getattr(snapshot, "fairbatching_pab_tokens", None)
    if pab is None:
        return None
    classes = getattr(snapshot, "fairbatching_admission", None)
    return RankBudget(
        rank=snapshot.dp_rank,
        pab_tokens=pab,
        echoed_dispatch_seq=snapshot.fairbatching_dispatch_seq,
        timestamp=snapshot.timestamp,
        class_budgets=dict(classes) if classes else None,
    )


def _routable_ranks(controller: Any) -> list[int]:
    return [
        rank
        for rank in controller._active_workers
        if controller.status[rank] and controller.workers[rank] is not None
    ]


def init_pab_dispatch(controller: Any, catalog: SloCatalog | None = None) -> None:
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().node_rank != 0:
        return  # only node 0 dispatches
    state = ControllerPab(catalog=catalog)
    controller.fairbatching_pab = state
    controller.dp_budget.fairbatching_pab_ledger = state.ledger

    ranks = _routable_ranks(controller)
    published = _await_first_snapshots(controller.load_snapshot_reader, ranks)
    without_pab = sorted(r for r, s in published.items() if rank_budget_of(s) is None)
    if without_pab:
        raise RuntimeError(
            f"--load-balance-method pab: DP rank(s) {without_pab} publish load snapshots "
            "without a Prefill Admission Budget; FairBatching must be enabled on every rank"
        )
    for snapshot in published.values():
        state.ledger.update(rank_budget_of(snapshot))
    silent = sorted(set(ranks) - set(published))
    if silent:
        logger.warning(
            "--load-balance-method pab: no load snapshot from DP rank(s) %s within %.0f s; "
            "requests go round robin until every rank has reported its PAB",
            silent,
            STARTUP_SNAPSHOT_TIMEOUT_S,
        )


def _await_first_snapshots(reader: Any, ranks: list[int]) -> dict[int, Any]:
    """Each rank's first published snapshot (timestamp > 0), waiting up to the timeout."""
    deadline = time.monotonic() + STARTUP_SNAPSHOT_TIMEOUT_S
    while True:
        published = {
            s.dp_rank: s for s in reader.read_all() if s.dp_rank in ranks and s.timestamp > 0
        }
        if len(published) == len(ranks) or time.monotonic() >= deadline:
            return published
        time.sleep(_STARTUP_POLL_S)


def after_update_budget(_result: None, budget: Any, loads: Any, *args: Any, **kwargs: Any) -> None:
    ledger = getattr(budget, "fairbatching_pab_ledger", None)
    if ledger is None:
        return
    for snapshot in loads:
        report = rank_budget_of(snapshot)
        if report is not None:
            ledger.update(report)


def pab_scheduler(controller: Any, req: Any) -> None:
    from sglang.srt.managers import data_parallel_controller as dpc

    if req.routed_dp_rank is not None:
        stamp_dispatch_seq(req, None)
        controller.maybe_external_dp_rank_routing(req)
        return
    state: ControllerPab = controller.fairbatching_pab
    ranks = _routable_ranks(controller)
    if not ranks:
        raise RuntimeError("No active DP workers are available for routing.")
    budgets = state.ledger.budgets(ranks, request_class(state.catalog, req))
    unreported = [rank for rank in ranks if rank not in budgets]
    if unreported:
        for rank in unreported:
            state.warn_once(
                rank,
                f"--load-balance-method pab: DP rank {rank} has not reported a PAB yet; "
                "routing round robin until it does",
            )
        stamp_dispatch_seq(req, None)
        controller.round_robin_scheduler(req)
        return
    prompt_tokens = prompt_tokens_of(req)
    rank = choose_rank(budgets, prompt_tokens)
    stamp_dispatch_seq(req, state.ledger.record_dispatch(rank, prompt_tokens))
    dpc.sock_send(controller.workers[rank], req)

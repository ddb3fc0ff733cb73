"""Routing on Prefill Admission Budgets across SGLang's data-parallel ranks.

The ledger lives in :mod:`controlplane.ledger` (shared with the control-plane daemon);
this module re-exports it under the names SGLang's ``pab`` load-balance method uses and
keeps that method's rank choice, which, unlike the daemon's ``pab`` balancer, always
picks a rank (SGLang's controller has no admission queue).
"""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.ledger import DispatchLedger, PabLedger, RankBudget

__all__ = ["DispatchLedger", "PabLedger", "RankBudget", "choose_rank"]


def choose_rank(budgets: Mapping[int, float], prompt_tokens: int) -> int:
    """A rank whose budget covers the prompt, largest budget first; else the largest budget.

    Ties go to the lowest rank. (If any rank covers the prompt, the largest budget does,
    so both cases pick the largest budget; the covering rule is stated for the contract.)
    """
    if not budgets:
        raise ValueError("choose_rank needs at least one rank's budget")
    by_preference = sorted(budgets, key=lambda rank: (-budgets[rank], rank))
    covering = [rank for rank in by_preference if budgets[rank] >= prompt_tokens]
    return covering[0] if covering else by_preference[0]

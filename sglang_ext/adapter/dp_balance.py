"""The rank choice of SGLang's ``pab`` load-balance method across data-parallel ranks. Pure.

Unlike the daemon's ``pab`` balancer it always picks a rank (SGLang's controller has no
admission queue). The ledger of budgets and debits it chooses from is
:mod:`controlplane.ledger`, shared with the control-plane daemon.
"""

from __future__ import annotations

from collections.abc import Mapping


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

"""The batch formation FairBatching is measured against, each registered in
:data:`sglang_ext.policy.policies.POLICIES` on import: the baselines users run
(``baselines``, and SGLang's own waiting orders in ``sglang_orders``), the batching study's policies (``study_policies``), Kairos and its
DistServe-like baseline (``kairos``, disaggregated) and SLO-aware annealing (``slo_anneal``)."""

from sglang_ext.sim.competitors import baselines, kairos, sglang_orders, slo_anneal, study_policies

__all__ = ["baselines", "kairos", "sglang_orders", "slo_anneal", "study_policies"]

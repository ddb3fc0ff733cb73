"""The batch formation FairBatching is measured against, each registered in
:data:`sglang_ext.policy.policies.POLICIES` on import: the baselines users run
(``baselines``), the batching study's policies (``study_policies``), Kairos and its
DistServe-like baseline (``kairos``, disaggregated) and SLO-aware annealing (``slo_anneal``)."""

from sglang_ext.sim.competitors import baselines, kairos, slo_anneal, study_policies

__all__ = ["baselines", "kairos", "slo_anneal", "study_policies"]

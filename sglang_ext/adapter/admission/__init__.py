"""Every way an SGLang server with FairBatching refuses, defers or ends a request early.

At the front door (the HTTP / TokenizerManager process, before a scheduler sees it):

- **400**, an SLO that is malformed or that no rank can honour (:mod:`.slo_validation`),
  or SLO hints that conflict or are malformed (``sglang_ext.adapter.hinted_slo``);
- **429**, admission mode ``reject``: a prompt larger than the budget its rank published
  for its SLO class (:mod:`.budget_gate` decides, :mod:`.budget_refusal` answers, with
  ``Retry-After``). The control plane's ingress agent gets the same refusal and turns it
  into the daemon's ``no_budget``.

In the scheduler (its hooks, ``sglang_ext.adapter.scheduler``), a request already queued:

- admission mode ``defer``: held back while its prompt does not fit the rank's budget,
  and ended after ``max_defer_s`` without a token (the policy decides,
  ``sglang_ext.policy.admission``; ``FairBatchingState.observe_prefills`` queues the abort);
- a request whose prompt and ``max_new_tokens`` need more KV than the whole pool holds:
  ended with that reason at the next request poll (``hooks._refuse_what_never_fits``).

The rules themselves (``edf``, ``pab``, headroom, give-up orders) are the policy's,
shared with the simulator: ``sglang_ext.policy.admission``.
"""

"""Decision rules of the baseline policies on hand-built request lists."""

from __future__ import annotations

import pytest
from sim_helpers import SLO, llama

from sglang_ext.policy.policies import POLICIES, PolicyContext
from sglang_ext.policy.view import RequestView
from sglang_ext.sim.competitors.baselines import Sarathi, SglangDefault, VllmDefault
from sglang_ext.sim.fitting.calibration import offline_fit
from sglang_ext.sim.runner import PolicySpecError, parse_policy

NOW = 10.0


def ctx(gpu_memory_gb: float = 80.0, token_budget: int | None = None) -> PolicyContext:
    return PolicyContext(
        global_slo=SLO,
        initial_step_model=offline_fit(llama()),
        gpu_memory_gb=gpu_memory_gb,
        token_budget=token_budget,
    )


def decoding(req_id, seq: int, context: int = 500) -> RequestView:
    return RequestView(req_id, seq * 0.01, SLO, 3, 0, context, max(1, context - 2), seq)


def waiting(req_id, seq: int, prompt: int) -> RequestView:
    return RequestView(req_id, seq * 0.01, SLO, 0, prompt, 0, prompt, seq)


def partial(req_id, seq: int, done: int, pending: int) -> RequestView:
    """A prefill that has computed ``done`` prompt tokens (a chunked request)."""
    return RequestView(req_id, seq * 0.01, SLO, 0, pending, done, done + pending, seq)


def test_baselines_are_registered():
    assert POLICIES.get("sglang-default") is SglangDefault
    assert POLICIES.get("vllm-default") is VllmDefault
    assert POLICIES.get("sarathi") is Sarathi
    assert Sarathi.takes_token_budget
    assert not SglangDefault.takes_token_budget and not VllmDefault.takes_token_budget
    assert parse_policy("sarathi@256").token_budget == 256
    with pytest.raises(PolicySpecError, match="takes no token budget"):
        parse_policy("vllm-default@256")


@pytest.mark.parametrize("policy_cls", [SglangDefault, VllmDefault, Sarathi])
def test_nothing_to_do_is_an_empty_batch(policy_cls):
    assert policy_cls(ctx()).form_batch([], NOW).is_empty


# ------------------------------------------------------------------ sglang-default
class TestSglangDefault:
    def test_decode_only_when_no_prefill_is_queued(self):
        requests = [decoding("d2", 2), decoding("d0", 0), decoding("d1", 1)]
        decision = SglangDefault(ctx()).form_batch(requests, NOW)
        assert decision.prefill_chunks == ()
        assert set(decision.decode_ids) == {"d0", "d1", "d2"}

    def test_any_queued_prefill_makes_a_prefill_only_batch(self):
        requests = [decoding("d0", 0), decoding("d1", 1), waiting("w", 2, 10)]
        decision = SglangDefault(ctx()).form_batch(requests, NOW)
        assert decision.decode_ids == ()
        assert decision.prefill_chunks == (("w", 10),)

    def test_chunked_request_first_then_fcfs(self):
        requests = [
            waiting("w5", 5, 100),
            waiting("w3", 3, 200),
            partial("c9", 9, done=8192, pending=300),  # arrived last, but is mid-prefill
            decoding("d", 0),
            waiting("w4", 4, 400),
        ]
        decision = SglangDefault(ctx()).form_batch(requests, NOW)
        assert decision.decode_ids == ()
        assert decision.prefill_chunks == (("c9", 300), ("w3", 200), ("w4", 400), ("w5", 100))

    @pytest.mark.parametrize(
        "memory_gb, cap", [(80.0, 8192), (60.0, 8192), (141.0, 8192), (59.9, 4096), (24.0, 4096)]
    )
    def test_chunk_cap_depends_on_gpu_memory(self, memory_gb, cap):
        policy = SglangDefault(ctx(memory_gb))
        assert policy.chunked_prefill_size == cap
        requests = [waiting("a", 0, 5000), waiting("b", 1, 5000), waiting("c", 2, 5000)]
        decision = policy.form_batch(requests, NOW)
        assert decision.new_tokens == cap
        expected = (("a", 5000), ("b", cap - 5000)) if cap > 5000 else (("a", cap),)
        assert decision.prefill_chunks == expected

    def test_long_prompt_is_chunked_across_steps(self):
        policy = SglangDefault(ctx())
        first = policy.form_batch([waiting("a", 0, 20_000)], NOW)
        assert first.prefill_chunks == (("a", 8192),)
        second = policy.form_batch([partial("a", 0, 8192, 20_000 - 8192)], NOW)
        assert second.prefill_chunks == (("a", 8192),)


# ------------------------------------------------------------------ vllm-default
class TestVllmDefault:
    def test_running_by_arrival_then_waiting_fcfs(self):
        requests = [
            waiting("w7", 7, 300),
            decoding("d4", 4),
            partial("p2", 2, done=1000, pending=500),
            waiting("w6", 6, 200),
            decoding("d1", 1),
        ]
        decision = VllmDefault(ctx()).form_batch(requests, NOW)
        assert decision.decode_ids == ("d1", "d4")
        assert decision.prefill_chunks == (("p2", 500), ("w6", 200), ("w7", 300))
        assert decision.new_tokens == 1002

    def test_token_budget_8192_cuts_the_last_waiting_request(self):
        requests = [
            decoding("d0", 0), decoding("d1", 1), waiting("a", 2, 6000), waiting("b", 3, 6000),
        ]
        decision = VllmDefault(ctx()).form_batch(requests, NOW)
        assert decision.decode_ids == ("d0", "d1")
        assert decision.prefill_chunks == (("a", 6000), ("b", 8192 - 2 - 6000))
        assert decision.new_tokens == 8192

    def test_budget_is_spent_in_arrival_order_among_running(self):
        # an older partial prefill uses the budget before younger decodes
        requests = [decoding("d2", 2), partial("p0", 0, done=100, pending=8191), decoding("d1", 1)]
        decision = VllmDefault(ctx()).form_batch(requests, NOW)
        assert decision.prefill_chunks == (("p0", 8191),)
        assert decision.decode_ids == ("d1",)  # d2 is out of budget this step

    @pytest.mark.parametrize("memory_gb, max_seqs", [(80.0, 1024), (70.0, 1024), (48.0, 256)])
    def test_max_num_seqs_limits_admissions(self, memory_gb, max_seqs):
        policy = VllmDefault(ctx(memory_gb))
        assert policy.max_num_seqs == max_seqs
        running = [decoding(f"d{i}", i) for i in range(max_seqs - 3)]
        queue = [waiting(f"w{i}", max_seqs + i, 1) for i in range(10)]
        decision = policy.form_batch(running + queue, NOW)
        assert len(decision.decode_ids) == max_seqs - 3
        assert [req_id for req_id, _ in decision.prefill_chunks] == ["w0", "w1", "w2"]

    def test_full_running_set_admits_nothing(self):
        policy = VllmDefault(ctx(48.0))
        running = [decoding(f"d{i}", i) for i in range(256)]
        decision = policy.form_batch(running + [waiting("w", 999, 10)], NOW)
        assert decision.prefill_chunks == () and len(decision.decode_ids) == 256


# ------------------------------------------------------------------ sarathi
class TestSarathi:
    def test_default_budget_and_swept_budget(self):
        assert Sarathi(ctx()).token_budget == 512
        assert Sarathi(ctx(token_budget=2048)).token_budget == 2048

    def test_every_decode_then_partial_then_waiting_to_the_budget(self):
        requests = [
            waiting("w3", 3, 400),
            decoding("d5", 5),
            partial("p8", 8, done=512, pending=100),
            decoding("d0", 0),
            waiting("w1", 1, 50),
        ]
        decision = Sarathi(ctx(token_budget=512)).form_batch(requests, NOW)
        assert set(decision.decode_ids) == {"d5", "d0"}
        # 512 - 2 decodes = 510: the partial prefill first, then FCFS, the last chunked
        assert decision.prefill_chunks == (("p8", 100), ("w1", 50), ("w3", 360))
        assert decision.new_tokens == 512

    def test_decodes_are_never_dropped_even_over_budget(self):
        requests = [decoding(f"d{i}", i) for i in range(20)] + [waiting("w", 50, 100)]
        decision = Sarathi(ctx(token_budget=16)).form_batch(requests, NOW)
        assert len(decision.decode_ids) == 20
        assert decision.prefill_chunks == ()

    def test_prefill_only_step_uses_the_whole_budget(self):
        decision = Sarathi(ctx(token_budget=1024)).form_batch([waiting("w", 0, 5000)], NOW)
        assert decision.decode_ids == () and decision.prefill_chunks == (("w", 1024),)

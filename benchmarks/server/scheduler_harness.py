"""Drive one real SGLang ``Scheduler`` in this process, step by step, on the emulated GPU.

:func:`run_scenario` runs it in a fresh interpreter (the plugin's hooks patch SGLang's
classes process-wide, so each scenario gets its own) for ``tests/adapter`` and
:mod:`benchmarks.server.adapter_cost`; by hand, from the repository's root::

    python -m benchmarks.server.scheduler_harness SCENARIO.json

The scenario names requests (prompt length, max new tokens, SLO, arrival step) and
server flags; the harness feeds them through the scheduler's real ingestion path
(``handle_generate_request``), runs the normal event loop's body one step at a time and
checks parked requests as it goes. It prints one JSON document: per-step records and
per-request outputs.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.server.emulated import PROFILE
from benchmarks.support.paths import pythonpath_with_checkout

RESULT_PREFIX = "HARNESS-RESULT "


class HarnessFailed(RuntimeError):
    """The harness exited with an error or printed no result; the message ends with its stderr."""


def run_scenario(scenario: Mapping[str, Any], workdir: Path, name: str, timeout_s: float,
                 env_extra: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``scenario`` (saved as ``WORKDIR/NAME.json``) in a fresh interpreter in
    ``workdir``, on the emulated GPU, FairBatching only where the scenario names a
    ``config``; return the harness's report."""
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(scenario))
    env = {**os.environ, "FAIRBATCHING_EMULATED_GPU": PROFILE, **(env_extra or {})}
    env.pop("FAIRBATCHING_CONFIG", None)
    env["PYTHONPATH"] = pythonpath_with_checkout(env)
    done = subprocess.run([sys.executable, "-m", "benchmarks.server.scheduler_harness", str(path)],
                          capture_output=True, text=True, env=env, cwd=workdir, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise HarnessFailed(f"{name}: exit code {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def main(scenario_path: str) -> None:
    scenario = json.loads(Path(scenario_path).read_text())
    if scenario.get("config"):
        os.environ["FAIRBATCHING_CONFIG"] = scenario["config"]
    else:
        os.environ.pop("FAIRBATCHING_CONFIG", None)
    from sglang.srt.plugins import load_plugins

    load_plugins()

    from sglang.srt.managers.io_struct import AbortReq

    scheduler = build_scheduler(scenario)
    outputs = _capture_outputs(scheduler)

    pending = sorted(scenario["requests"], key=lambda r: r.get("at_step", 0))
    steps: list[dict[str, Any]] = []
    kv_rows: dict[str, list[int]] = {}
    checks = {"parked_kv_kept": 0, "parked_relay_token_ok": 0, "parked_kv_changed": 0,
              "relay_token_wrong": 0, "sampling_rows_ok": 0, "sampling_rows_wrong": 0,
              "batch_rows_ok": 0, "batch_rows_wrong": 0, "queued_with_view": 0,
              "queued_without_view": 0}
    state = getattr(scheduler, "fairbatching", None)
    if state is not None and scenario.get("publish_budgets"):
        state.publishes_budgets = True  # as behind the control plane or DP's pab method
    if state is not None:  # auto: tables from the adapter's threshold; tables: always; lists: never
        path = scenario.get("decision_path", "auto")
        if path != "auto":
            state.table_min_requests = {"tables": 0, "lists": None}[path]
    if state is not None and scenario.get("prefill_piece_tokens"):
        _cap_planned_prefills(state, int(scenario["prefill_piece_tokens"]))
    # the tests read each decision's triage; a benchmark of the adapter's cost does not
    # (recording runs the policy's triage a second time per step)
    recording = state is not None and scenario.get("record_triage", True)
    triage = _record_triage(state) if recording else None
    # each batch's rows against its requests; a benchmark of the scheduler's cost does not
    # check them (a pass over every request between steps warms what the next one reads)
    check_rows = scenario.get("check_rows", True)
    observations = _record_observations(state) if state is not None else None
    last_batch = None
    aborted: dict[str, int] = {}
    retracted = 0
    step = 0
    deadline = time.monotonic() + scenario.get("timeout_s", 120)
    while time.monotonic() < deadline:
        while pending and pending[0].get("at_step", 0) <= step:
            submit(scheduler, pending.pop(0))
        scheduler.process_input_requests(scheduler._poll_timeout_aborts())  # as ingest_requests does
        if state is not None and check_rows and state.calibration is None:
            _check_arrival_views(scheduler.waiting_queue, checks)

        if state is not None and state.parked is not None:
            _check_parked(scheduler, state.parked, kv_rows, checks, expect_relay=True)
            if check_rows:
                _check_sampling_rows(state.parked, checks)
                _check_batch_rows(state.parked, checks)
        for rid in scenario.get("abort_when_parked", []):
            if rid not in aborted and state is not None and state.parked is not None and any(
                r.rid == rid for r in state.parked.reqs
            ):
                scheduler.abort_request(AbortReq(rid=rid))
                aborted[rid] = step
        if triage is not None:
            triage.clear()
        decisions = state.counters.decisions if state is not None else 0
        formed = time.perf_counter()
        plan = scheduler.get_next_batch_to_run(scheduler.running_batch, last_batch)
        formed = time.perf_counter() - formed
        reporter = scheduler.metrics_reporter
        retracted += getattr(reporter, "num_retracted_reqs", 0) or 0
        reporter.num_retracted_reqs = 0
        scheduler.running_batch = plan.running_batch
        batch = plan.batch_to_run
        record = _step_record(scheduler, batch, state, step)
        if batch is not None and check_rows:
            _check_sampling_rows(batch, checks)
            _check_batch_rows(batch, checks)
        if triage and batch is not None:
            record["triage"] = triage[-1]
        record["get_next_batch_us"] = round(formed * 1e6, 1)
        if state is not None and state.counters.decisions > decisions:
            record["decision_us"] = round(state.decision_s[-1] * 1e6, 1)  # adapter + policy
        if state is not None and state.parked is not None:
            for req in state.parked.reqs:
                kv_rows[req.rid] = _kv_row(scheduler, req)
        learned = state.counters.steps if state is not None else 0
        run_step(scheduler, batch, last_batch)
        if state is not None and state.counters.steps > learned:
            record["learning_us"] = round(state.learning_s[-1] * 1e6, 1)  # after this step
        last_batch = batch
        if batch is not None:
            steps.append(record)
        step += 1
        if not pending and batch is None and scheduler.is_fully_idle() and not scheduler.waiting_queue:
            break
        if step >= scenario.get("max_steps", 1_000_000):
            break

    allocator = scheduler.token_to_kv_pool_allocator
    tree = scheduler.tree_cache
    evictable = tree.evictable_size() if hasattr(tree, "evictable_size") else 0
    report = {
        "steps": steps,
        "outputs": outputs,
        "checks": checks,
        "aborted_at_step": aborted,
        "retracted": retracted,
        "idle": scheduler.is_fully_idle(),
        "kv_free_plus_evictable": allocator.available_size() + evictable,
        "kv_total": scheduler.max_total_num_tokens,
        "fairbatching": state.snapshot() if state is not None else None,
        "observations": observations,
    }
    print(RESULT_PREFIX + json.dumps(report))


def build_scheduler(scenario: Mapping[str, Any]) -> Any:
    """A real SGLang ``Scheduler`` on the emulated GPU (a tiny model with dummy weights,
    CPU), with the scenario's server flags."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="fb-harness-")))
    atexit.register(shutil.rmtree, model_dir, ignore_errors=True)
    server_args = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        load_format="dummy",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        skip_tokenizer_init=True,
        max_total_tokens=scenario.get("max_total_tokens", 65536),
        chunked_prefill_size=scenario.get("chunked_prefill_size", 8192),
        disable_overlap_schedule=not scenario.get("overlap", False),
        disable_radix_cache=scenario.get("disable_radix_cache", False),
        enable_mixed_chunk=scenario.get("enable_mixed_chunk", False),
        enable_priority_scheduling=scenario.get("enable_priority_scheduling", False),
        max_running_requests=scenario.get("max_running_requests"),
        schedule_policy=scenario.get("schedule_policy", "fcfs"),
    )
    port_args = PortArgs.init_new(server_args)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    return Scheduler(server_args, port_args)


def submit(scheduler: Any, spec: Mapping[str, Any]) -> None:
    """Feed one request through the scheduler's real ingestion path."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    custom_params = {"slo": spec["slo"]} if "slo" in spec else None
    params = SamplingParams(max_new_tokens=spec["max_new_tokens"], ignore_eos=spec.get("ignore_eos", True),
                            custom_params=custom_params, **spec.get("sampling", {}))
    params.normalize(None)
    recv = TokenizedGenerateReqInput(
        rid=spec["rid"], input_text=None,
        input_ids=array("q", _prompt(spec)),
        input_embeds=None, mm_inputs=None, token_type_ids=None, sampling_params=params,
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
        token_ids_logprob=None, stream=True, priority=spec.get("priority"),
    )
    scheduler.handle_generate_request(recv)


def run_step(scheduler: Any, batch: Any, last_batch: Any) -> None:
    """The body of SGLang's normal or overlap event loop after the batch is formed:
    run ``batch`` (overlap: launch it, then process ``last_batch``'s result), or idle."""
    if scheduler.enable_overlap:
        result_queue = scheduler.result_queue
        result = None
        if batch:
            result = scheduler.run_batch(batch)
            result_queue.append((batch.copy(), result))
        if last_batch:
            tmp_batch, tmp_result = result_queue.popleft()
            scheduler.process_batch_result(tmp_batch, tmp_result)
        elif batch is None:
            scheduler.on_idle()
        if batch is not None:
            scheduler.launch_batch_sample_if_needed(result, batch)
    else:
        if batch:
            result = scheduler.run_batch(batch)
            scheduler.process_batch_result(batch, result)
        else:
            scheduler.on_idle()
    scheduler.last_batch = batch


def _record_triage(state: Any) -> list[dict[str, Any]]:
    """What each decision saw, from the policy's own triage (Algorithm 1's groups): the
    decodes it must run (urgent, or late under the lateness guard) and the deferrable
    ones with their slack. Tests check parking against it, so their verdict does not
    depend on how fast this machine ran the steps."""
    policy = state.policy
    form_batch = policy.form_batch
    seen: list[dict[str, Any]] = []

    def recording_form_batch(requests: Any, now: float) -> Any:
        groups = policy._triage(requests, now, getattr(policy, "anchored", False))
        if groups is not None:
            seen.append({
                "must_run": sorted(str(r.req_id) for _, r in (*groups.urgent_decodes, *groups.late_decodes)),
                "deferrable": {str(r.req_id): round(slack * 1e3, 3) for slack, r in groups.deferrable_decodes},
                "urgent_below_ms": round((groups.init_time_budget_s + groups.min_tpot_s) * 1e3, 3),
            })
        return form_batch(requests, now)

    policy.form_batch = recording_form_batch
    return seen


def _cap_planned_prefills(state: Any, piece: int) -> None:
    """Plan every queued prefill each step, at most ``piece`` tokens each: several
    partial chunks in one step, which SGLang's adder (one chunked request at a time)
    must be kept from realising."""
    import dataclasses

    policy = state.policy
    form_batch = policy.form_batch

    def capped_form_batch(requests: Any, now: float) -> Any:
        decision = form_batch(requests, now)
        waiting = [r for r in requests if r.pending_prefill > 0]
        if not waiting:
            return decision
        chunks = tuple((r.req_id, min(piece, r.pending_prefill)) for r in waiting)
        return dataclasses.replace(decision, prefill_chunks=chunks)

    policy.form_batch = capped_form_batch


def _record_observations(state: Any) -> list[tuple[int, int, float]]:
    """Every measured step the online step model learns from: (new tokens, context, seconds)."""
    policy = state.policy
    observe_step = policy.observe_step
    seen: list[tuple[int, int, float]] = []

    def recording_observe_step(shape: Any, measured_s: float) -> None:
        seen.append((int(shape.new_tokens), int(shape.total_context), float(measured_s)))
        observe_step(shape, measured_s)

    policy.observe_step = recording_observe_step
    return seen


def _prompt(spec: dict[str, Any]) -> list[int]:
    """Distinct prompts per request unless a scenario shares a ``prefix_group``."""
    seed = sum(map(ord, spec.get("prefix_group", spec["rid"])))
    return [7 + (i * 31 + seed) % 900 for i in range(spec["prompt_tokens"])]


def _capture_outputs(scheduler: Any) -> dict[str, dict[str, Any]]:
    """Collect what the scheduler sends to the detokenizer (no detokenizer runs here) and
    the aborts it reports to the tokenizer outside the output stream. Per request: its
    tokens, its finish reason, how many chunks and how many final answers (``finals``:
    chunks with a finish reason) it streamed, and how many ``AbortReq`` it was sent."""
    outputs: dict[str, dict[str, Any]] = {}

    def entry(rid: str) -> dict[str, Any]:
        return outputs.setdefault(rid, {"tokens": 0, "finished": None, "chunks": 0, "finals": 0,
                                        "abort_reports": 0})

    def send_output(output: Any, recv_obj: Any = None) -> None:
        rids = getattr(output, "rids", None) or []
        completion = getattr(output, "completion_tokens", None) or []
        reasons = getattr(output, "finished_reasons", None) or []
        for i, rid in enumerate(rids):
            record = entry(rid)
            record["chunks"] += 1
            if i < len(completion):
                record["tokens"] = int(completion[i])
            if i < len(reasons) and reasons[i] is not None:
                reason = reasons[i]
                record["finished"] = reason.get("type") if isinstance(reason, dict) else str(reason)
                record["finals"] += 1

    def send_to_tokenizer(output: Any, recv_obj: Any = None) -> None:
        from sglang.srt.managers.io_struct import AbortReq

        if isinstance(output, AbortReq) and output.rid is not None:
            record = entry(output.rid)
            record["abort_reports"] += 1
            record["finished"] = record["finished"] or "abort"

    scheduler.ipc_channels.send_to_detokenizer.send_output = send_output
    scheduler.ipc_channels.send_to_tokenizer.send_output = send_to_tokenizer
    return outputs


def _pool_row(req: Any) -> int:
    return req.req_pool_idx if hasattr(req, "req_pool_idx") else req.kv.req_pool_idx


def _kv_row(scheduler: Any, req: Any) -> list[int]:
    idx = _pool_row(req)
    length = len(req.origin_input_ids) + max(0, len(req.output_ids) - 1)
    return scheduler.req_to_token_pool.req_to_token[idx, :length].tolist()


def _check_parked(scheduler: Any, parked: Any, kv_rows: dict, checks: dict, expect_relay: bool) -> None:
    relay = scheduler.future_map.output_tokens_buf if hasattr(scheduler, "future_map") else None
    for req in parked.reqs:
        if req.finished():
            continue
        before = kv_rows.get(req.rid)
        if before is not None:
            now = _kv_row(scheduler, req)
            if now[: len(before)] == before:
                checks["parked_kv_kept"] += 1
            else:
                checks["parked_kv_changed"] += 1
        if relay is not None and req.output_ids:
            idx = _pool_row(req)
            if int(relay[idx]) == int(req.output_ids[-1]):
                checks["parked_relay_token_ok"] += 1
            else:
                checks["relay_token_wrong"] += 1


def _check_sampling_rows(batch: Any, checks: dict) -> None:
    """Whether ``batch``'s sampling rows are its requests' parameters, row by row."""
    info = batch.sampling_info
    if info is None:
        return
    expected = [(r.sampling_params.temperature, r.sampling_params.top_p, r.sampling_params.top_k)
                for r in batch.reqs]
    got = list(zip(info.temperatures.view(-1).tolist(), info.top_ps.tolist(), info.top_ks.tolist(),
                   strict=False))
    same = len(got) == len(expected) and all(
        abs(t - et) < 1e-6 and abs(p - ep) < 1e-6 and k == ek
        for (t, p, k), (et, ep, ek) in zip(got, expected, strict=True))
    checks["sampling_rows_ok" if same else "sampling_rows_wrong"] += 1


def _check_batch_rows(batch: Any, checks: dict) -> None:
    """Whether ``batch``'s per-row tensors follow its requests (their request-pool rows, one
    sequence length each, the host copies equal to the device ones) and its flags are
    what its requests ask for, as SGLang's own ``filter_batch`` would leave them."""
    from sglang.srt.managers.schedule_batch import get_batch_return_hidden_states_mode

    reqs = batch.reqs
    if not reqs or batch.req_pool_indices is None:
        return
    rows = [_pool_row(req) for req in reqs]
    same = (batch.req_pool_indices.tolist() == rows and batch.req_pool_indices_cpu.tolist() == rows
            and len(batch.seq_lens) == len(batch.orig_seq_lens) == len(reqs)
            and (batch.seq_lens_cpu is None or batch.seq_lens_cpu.tolist() == batch.seq_lens.tolist())
            and batch.return_logprob == any(req.return_logprob for req in reqs)
            and batch.has_grammar == any(req.grammar for req in reqs)
            and batch.return_hidden_states_mode == get_batch_return_hidden_states_mode(reqs))
    checks["batch_rows_ok" if same else "batch_rows_wrong"] += 1


def _check_arrival_views(waiting: list[Any], checks: dict[str, int]) -> None:
    """Each queued request has its view before a decision reads it: made as it arrived."""
    from sglang_ext.adapter.scheduler.requests import RECORD_ATTR

    for req in waiting:
        has_view = getattr(req, RECORD_ATTR, None) is not None
        checks["queued_with_view" if has_view else "queued_without_view"] += 1


def _step_record(scheduler: Any, batch: Any, state: Any, step: int) -> dict[str, Any]:
    from sglang_ext.adapter.scheduler.step_features import step_features

    record: dict[str, Any] = {"step": step}
    if batch is None:
        return record
    features = step_features(batch)
    record.update(
        mode=str(batch.forward_mode.name),
        new_tokens=features.new_tokens,
        prefill_tokens=features.prefill_tokens,
        decodes=sorted(r.rid for r in (batch.decoding_reqs or [])) if batch.forward_mode.is_extend()
        else sorted(r.rid for r in batch.reqs),
        prefills={r.rid: r.extend_len for r in batch.reqs if r not in (batch.decoding_reqs or [])}
        if batch.forward_mode.is_extend() else {},
        parked=sorted(r.rid for r in state.parked.reqs) if state is not None and state.parked is not None else [],
        waiting=len(scheduler.waiting_queue),
        pab=state.pab_tokens if state is not None else None,
    )
    if state is not None and state.last_decision is not None:
        decision = state.last_decision
        record.update(
            planned_prefill=dict(decision.prefill_chunks),
            planned_decodes=len(decision.decode_ids),
            predicted_s=decision.predicted_step_s,
            time_budget_s=decision.time_budget_s,
        )
    return record


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_LOG_LEVEL", "warning")
    main(sys.argv[1])

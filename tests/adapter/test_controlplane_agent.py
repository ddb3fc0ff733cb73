"""The control-plane ingress on SGLang's own objects: Dispatch -> ``GenerateReqInput``
(accepted by SGLang's normalisation, sampling parameters and the SLO front door), SGLang's
finish reasons (its ``FINISH_*`` classes) -> the control plane's, and the engine behind a
real :class:`RankAgent` talking to a scripted daemon socket: streamed Output deltas and one
Done, invalid requests, aborts reaching the TokenizerManager."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

import zmq
import zmq.asyncio

from controlplane import protocol as p
from controlplane.rank_agent import RankAgent
from sglang_ext.adapter import controlplane_agent as cpa

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]


def dispatch(request_id: str = "r1", *, rank: str = "srv:1/1", prompt: p.Prompt | None = None,
             sampling: p.SamplingParams | None = None, slo: p.SloSpec | None = None,
             seq: int = 7, epoch: int = 5, stream: bool = True) -> p.Dispatch:
    return p.Dispatch(request_id=request_id, rank=rank, epoch=epoch, dispatch_seq=seq,
                      prompt=prompt or p.Prompt(token_ids=[5, 6, 7, 8]),
                      sampling=sampling or p.SamplingParams(max_new_tokens=4, ignore_eos=True),
                      slo=slo, stream=stream)


class ByteTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


# --------------------------------------------------------------------- conversion
def test_dispatch_becomes_a_streamed_pinned_generate_request() -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sampling = p.SamplingParams(max_new_tokens=12, temperature=0.5, top_p=0.9, top_k=20,
                                min_new_tokens=2, stop=["\n\n", "END"], ignore_eos=True, seed=3)
    obj = cpa.generate_request_input(
        dispatch("req-9", sampling=sampling, slo=p.SloSpec(slo_class="interactive"), seq=41),
        dp_index=1, dp_size=2)
    assert isinstance(obj, GenerateReqInput)
    assert (obj.rid, obj.input_ids, obj.text, obj.stream, obj.routed_dp_rank) == \
        ("req-9", [5, 6, 7, 8], None, True, 1)
    assert obj.sampling_params == {
        "max_new_tokens": 12, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_new_tokens": 2,
        "ignore_eos": True, "stop": ["\n\n", "END"], "sampling_seed": 3,
        "custom_params": {"_fairbatching_controlplane_seq": [0, 41], "slo": {"class": "interactive"}},
    }
    obj.normalize_batch_and_arguments()  # what TokenizerManager.generate_request does first
    assert obj.is_single
    params = SamplingParams(**obj.sampling_params)
    params.normalize(ByteTokenizer())
    params.verify(vocab_size=1000)
    assert params.custom_params["_fairbatching_controlplane_seq"] == [0, 41]
    assert params.stop_strs == ["\n\n", "END"]


def test_single_rank_servers_are_not_pinned_and_text_prompts_pass_through() -> None:
    obj = cpa.generate_request_input(
        dispatch(prompt=p.Prompt(text="hello there"), slo=p.SloSpec(ttft_ms=800.0, tpot_ms=40.0)),
        dp_index=0, dp_size=1)
    assert obj.routed_dp_rank is None
    assert (obj.text, obj.input_ids) == ("hello there", None)
    assert "stop" not in obj.sampling_params and "sampling_seed" not in obj.sampling_params
    assert obj.sampling_params["custom_params"] == {
        "_fairbatching_controlplane_seq": [0, 7], "slo": {"ttft_ms": 800.0, "tpot_ms": 40.0}}
    without_slo = cpa.generate_request_input(dispatch(), 0, 1)
    assert without_slo.sampling_params["custom_params"] == {"_fairbatching_controlplane_seq": [0, 7]}
    obj.normalize_batch_and_arguments()


def test_the_dispatch_seq_is_what_the_scheduler_side_reads_and_the_slo_front_door_checks() -> None:
    from types import SimpleNamespace

    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_ext.adapter.custom_params import custom_param
    from sglang_ext.adapter.dp_pab import dispatch_seq_of
    from sglang_ext.adapter.admission.slo_validation import check_request_slo
    from sglang_ext.policy.slo import SloCatalog

    obj = cpa.generate_request_input(dispatch(seq=123, slo=p.SloSpec(slo_class="relaxed")), 0, 1,
                                     daemon_slot=1)
    req = SimpleNamespace(sampling_params=SamplingParams(**obj.sampling_params))
    assert custom_param(req, cpa.CONTROLPLANE_SEQ_KEY) == [1, 123]
    assert dispatch_seq_of(req) is None  # not the DP controller's numbering
    catalog = SloCatalog.from_toml(REPO / "configs" / "slo.toml")
    check_request_slo(catalog, obj.sampling_params)
    bad = cpa.generate_request_input(dispatch(slo=p.SloSpec(slo_class="no-such-class")), 0, 1)
    with pytest.raises(ValueError, match="no-such-class"):
        check_request_slo(catalog, bad.sampling_params)


def test_sglang_finish_reasons_map_to_the_control_planes() -> None:
    from sglang.srt.managers.schedule_batch import (
        FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN,
    )

    def outcome(reason: Any) -> cpa.FinishOutcome | None:
        return cpa.finish_outcome({"finish_reason": None if reason is None else reason.to_json()})

    assert outcome(None) is None
    assert cpa.finish_outcome(None) is None
    assert outcome(FINISH_LENGTH(length=16)) == cpa.FinishOutcome("length")
    assert outcome(FINISH_MATCHED_STR(matched="END")) == cpa.FinishOutcome("stop")
    assert outcome(FINISH_MATCHED_TOKEN(matched=2)) == cpa.FinishOutcome("stop")
    assert outcome(FINISH_ABORT()) == cpa.FinishOutcome("cancelled", "Aborted")
    assert outcome(FINISH_ABORT("too long", status_code=400)) == \
        cpa.FinishOutcome("error", "too long", invalid=True)
    assert outcome(FINISH_ABORT("oom", status_code=503)) == cpa.FinishOutcome("error", "503: oom")
    for reason in ("length", "stop", "cancelled", "error"):
        p.FinishReason(reason)  # every outcome names a protocol reason


def test_output_deltas_for_cumulative_and_incremental_streams() -> None:
    cumulative = cpa.OutputDeltas(incremental=False)
    ids: list[int] = []  # SGLang hands out its own growing list
    ids += [1, 2]
    assert cumulative.delta({"output_ids": ids, "text": "ab"}) == ([1, 2], "ab")
    assert cumulative.delta({"output_ids": ids, "text": "ab"}) == ([], "")
    ids += [3]
    assert cumulative.delta({"output_ids": ids, "text": "abc"}) == ([3], "c")
    assert cumulative.delta({"output_ids": ids}) == ([], "")  # --skip-tokenizer-init: no text
    incremental = cpa.OutputDeltas(incremental=True)
    assert incremental.delta({"output_ids": [4], "text": "d"}) == ([4], "d")
    assert incremental.delta({"output_ids": [5, 6], "text": "ef"}) == ([5, 6], "ef")


# --------------------------------------------------------------------- settings
def test_settings_need_both_addresses_and_fairbatching() -> None:
    assert cpa.settings_from_environment({}, fairbatching_on=True) is None
    env = {cpa.CONTROLPLANE_ENV: "tcp://127.0.0.1:5561", cpa.REPORTS_ENV: "tcp://127.0.0.1:5562"}
    settings = cpa.settings_from_environment(env, fairbatching_on=True)
    assert settings is not None and settings.rank_prefix is None
    assert env[cpa.EPOCH_ENV] == str(settings.epoch)  # the launcher hands it to its children
    again = cpa.settings_from_environment(env, fairbatching_on=True)
    assert again.epoch >= settings.epoch  # a root process always draws a fresh one
    with pytest.raises(cpa.ControlPlaneConfigError, match="FAIRBATCHING_CONFIG"):
        cpa.settings_from_environment(dict(env), fairbatching_on=False)
    with pytest.raises(cpa.ControlPlaneConfigError, match=cpa.REPORTS_ENV):
        cpa.settings_from_environment({cpa.CONTROLPLANE_ENV: "tcp://127.0.0.1:5561"}, fairbatching_on=True)
    with pytest.raises(cpa.ControlPlaneConfigError, match=cpa.CONTROLPLANE_ENV):
        cpa.settings_from_environment({cpa.REPORTS_ENV: "tcp://127.0.0.1:5562"}, fairbatching_on=True)
    with pytest.raises(cpa.ControlPlaneConfigError, match="expected tcp"):
        cpa.settings_from_environment({**env, cpa.CONTROLPLANE_ENV: "127.0.0.1:5561"}, fairbatching_on=True)
    with pytest.raises(cpa.ControlPlaneConfigError, match="printable ASCII"):
        cpa.settings_from_environment({**env, cpa.RANK_NAME_ENV: "has space"}, fairbatching_on=True)
    named = cpa.settings_from_environment({**env, cpa.RANK_NAME_ENV: "gpu-a"}, fairbatching_on=True)
    assert named.rank_prefix == "gpu-a"


def test_several_daemons_are_comma_separated_and_paired_in_order() -> None:
    env = {cpa.CONTROLPLANE_ENV: "tcp://10.0.0.5:5561, tcp://10.0.0.6:5561",
           cpa.REPORTS_ENV: "tcp://10.0.0.5:5562,tcp://10.0.0.6:5562"}
    settings = cpa.settings_from_environment(env, fairbatching_on=True)
    assert settings.rank_addresses == ("tcp://10.0.0.5:5561", "tcp://10.0.0.6:5561")
    assert settings.report_addresses == ("tcp://10.0.0.5:5562", "tcp://10.0.0.6:5562")
    assert settings.rank_address == "tcp://10.0.0.5:5561"
    with pytest.raises(cpa.ControlPlaneConfigError, match="names 2 daemons and .* 1"):
        cpa.settings_from_environment({**env, cpa.REPORTS_ENV: "tcp://10.0.0.5:5562"}, fairbatching_on=True)
    with pytest.raises(cpa.ControlPlaneConfigError, match="distinct"):
        cpa.settings_from_environment({cpa.CONTROLPLANE_ENV: "tcp://a:1,tcp://a:1",
                                       cpa.REPORTS_ENV: "tcp://a:2,tcp://b:2"}, fairbatching_on=True)
    with pytest.raises(cpa.ControlPlaneConfigError, match="expected tcp"):
        cpa.settings_from_environment({**env, cpa.CONTROLPLANE_ENV: "tcp://a:1,"}, fairbatching_on=True)


def test_curve_settings_go_together_and_their_key_files_are_checked_at_start_up(tmp_path) -> None:
    from controlplane.curve import generate

    daemon_key, _ = generate(tmp_path, "daemon")
    _, server_secret = generate(tmp_path, "gpu-a")
    env = {cpa.CONTROLPLANE_ENV: "tcp://10.0.0.5:5561", cpa.REPORTS_ENV: "tcp://10.0.0.5:5562"}
    curve = {cpa.CURVE_SERVER_KEY_ENV: str(daemon_key), cpa.CURVE_SECRET_KEY_ENV: str(server_secret)}
    settings = cpa.settings_from_environment({**env, **curve}, fairbatching_on=True)
    peer = settings.curve_peer()
    assert peer.server_public == (tmp_path / "daemon.key").read_text().split('"')[1].encode()
    assert cpa.settings_from_environment(dict(env), fairbatching_on=True).curve_peer() is None
    with pytest.raises(cpa.ControlPlaneConfigError, match="go together"):
        cpa.settings_from_environment({**env, cpa.CURVE_SERVER_KEY_ENV: str(daemon_key)}, fairbatching_on=True)
    with pytest.raises(cpa.ControlPlaneConfigError, match="no secret key"):
        cpa.settings_from_environment({**env, **curve, cpa.CURVE_SECRET_KEY_ENV: str(daemon_key)},
                                      fairbatching_on=True)


@pytest.mark.parametrize(("text", "seconds"), [("", 0.0), ("0", 0.0), ("5", 0.005), (" 12.5 ", 0.0125),
                                             ("50", 0.05)])
def test_the_coalescing_window_is_read_in_milliseconds(text: str, seconds: float) -> None:
    env = {cpa.CONTROLPLANE_ENV: "tcp://127.0.0.1:5561", cpa.REPORTS_ENV: "tcp://127.0.0.1:5562"}
    assert cpa.settings_from_environment(dict(env), fairbatching_on=True).coalesce_s == 0.0  # unset
    settings = cpa.settings_from_environment({**env, cpa.COALESCE_ENV: text}, fairbatching_on=True)
    assert settings.coalesce_s == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["-1", "-0.5", "abc", "5ms", "50.01", "1000", "nan", "inf"])
def test_a_bad_coalescing_window_is_refused_in_one_line_stating_the_bound(text: str) -> None:
    env = {cpa.CONTROLPLANE_ENV: "tcp://127.0.0.1:5561", cpa.REPORTS_ENV: "tcp://127.0.0.1:5562",
           cpa.COALESCE_ENV: text}
    with pytest.raises(cpa.ControlPlaneConfigError) as refused:
        cpa.settings_from_environment(env, fairbatching_on=True)
    message = str(refused.value)
    assert message.startswith(f"{cpa.COALESCE_ENV}: expected milliseconds from 0 to 50, got {text!r}")
    assert "50 ms TPOT SLO" in message and "\n" not in message
    assert cpa.EPOCH_ENV not in env  # refused before anything else happened


def test_a_coalescing_window_without_a_control_plane_is_refused() -> None:
    with pytest.raises(cpa.ControlPlaneConfigError,
                       match=f"{cpa.COALESCE_ENV} is set but {cpa.CONTROLPLANE_ENV} is not"):
        cpa.settings_from_environment({cpa.COALESCE_ENV: "5"}, fairbatching_on=True)


def test_the_server_refuses_to_start_with_a_bad_coalescing_window(monkeypatch) -> None:
    from sglang_ext.adapter import plugin

    monkeypatch.delenv(plugin.EMULATED_GPU_ENV, raising=False)
    monkeypatch.setenv("FAIRBATCHING_CONFIG", str(REPO / "configs" / "fairbatching.toml"))
    monkeypatch.setenv(cpa.CONTROLPLANE_ENV, "tcp://127.0.0.1:5561")
    monkeypatch.setenv(cpa.REPORTS_ENV, "tcp://127.0.0.1:5562")
    monkeypatch.setenv(cpa.COALESCE_ENV, "80")
    monkeypatch.delenv(cpa.EPOCH_ENV, raising=False)
    with pytest.raises(SystemExit) as stopped:
        plugin.register()
    assert str(stopped.value.code).startswith(
        f"FairBatching: {cpa.COALESCE_ENV}: expected milliseconds from 0 to 50, got '80'")


def test_rank_names_and_server_checks() -> None:
    from types import SimpleNamespace

    assert cpa.default_rank_prefix("127.0.0.1", 30000) == "127.0.0.1:30000"
    assert cpa.default_rank_prefix("0.0.0.0", 30000).endswith(":30000")
    assert cpa.rank_names("h:1", 2) == ["h:1/0", "h:1/1"]
    with pytest.raises(cpa.ControlPlaneConfigError):
        cpa.check_rank_prefix("x" * 63, dp_size=2)
    ok = SimpleNamespace(tokenizer_worker_num=1, enable_dp_attention=False, dp_size=2,
                         load_balance_method="round_robin")
    cpa.check_server_args(ok)
    for bad in ({"load_balance_method": "pab"}, {"enable_dp_attention": True},
                {"tokenizer_worker_num": 2}):
        with pytest.raises(cpa.ControlPlaneConfigError):
            cpa.check_server_args(SimpleNamespace(**{**vars(ok), **bad}))


# --------------------------------------------------------------------- engine
class FakeTokenizerManager:
    """``generate_request`` streams like SGLang's (cumulative ``output_ids``/``text``,
    ``meta_info`` with a ``finish_reason`` from SGLang's FINISH classes on the last chunk)."""

    incremental_streaming_output = False

    def __init__(self) -> None:
        self.rid_to_state: dict[str, object] = {}
        self.requests: list[Any] = []
        self.aborted: list[str] = []

    async def generate_request(self, obj: Any, request: Any = None):
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

        obj.normalize_batch_and_arguments()
        slo = obj.sampling_params["custom_params"].get("slo") or {}
        if slo.get("class") == "no-such-class":
            raise ValueError("invalid SLO in custom_params: unknown SLO class 'no-such-class'")
        self.requests.append(obj)
        self.rid_to_state[obj.rid] = object()
        try:
            total = obj.sampling_params["max_new_tokens"]
            prompt = len(obj.input_ids or [])
            ids: list[int] = []
            for step in range(total):
                await asyncio.sleep(0.2 if slo.get("class") == "relaxed" else 0.001)
                ids.append(100 + step)
                finished = step == total - 1
                reason = FINISH_LENGTH(length=total).to_json() if finished else None
                if slo.get("class") == "tight" and step == 1:
                    reason, finished = FINISH_ABORT("input too long", status_code=400).to_json(), True
                if obj.stream or finished:  # unstreamed: SGLang yields once, at the finish
                    yield {"text": "".join(chr(97 + (t % 26)) for t in ids), "output_ids": ids,
                           "meta_info": {"id": obj.rid, "finish_reason": reason, "prompt_tokens": prompt,
                                         "completion_tokens": len(ids)}}
                if finished:
                    return
        finally:
            self.rid_to_state.pop(obj.rid, None)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)


class ScriptedDaemon:
    """A ROUTER standing in for the daemon's rank socket."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.agent = b""
        self.to_agent = p.daemon_to_agent_channel()
        self.from_agent = p.agent_message_channel()
        self.backlog: list[p.AgentMessage] = []  # the rest of a RankOutputs

    async def recv(self, timeout: float = 10.0) -> p.AgentMessage:
        while True:
            if not self.backlog:
                identity, frame = await asyncio.wait_for(self.socket.recv_multipart(), timeout)
                self.agent = identity
                self.backlog = p.unbatched(self.from_agent.decode(frame))
            message = self.backlog.pop(0)
            if not isinstance(message, p.Heartbeat):
                return message

    async def send(self, message: Any) -> None:
        await self.socket.send_multipart([self.agent, p.encode(message)])

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


async def _run_engine_scenario() -> dict[str, Any]:
    daemon = ScriptedDaemon()
    tm = FakeTokenizerManager()
    ranks = ["srv:1/0", "srv:1/1"]
    engine = cpa.SGLangRankEngine(tm, {r: i for i, r in enumerate(ranks)}, 2, "tcp://127.0.0.1:1")
    agent = RankAgent(daemon.address, "srv:1", ranks, engine, epoch=5, hello_retry_s=0.2)
    task = asyncio.create_task(agent.run())
    done: dict[str, p.Done] = {}
    outputs: dict[str, list[p.Output]] = {}
    try:
        hellos = set()
        while len(hellos) < 2:
            hello = await daemon.recv()
            assert isinstance(hello, p.Hello) and hello.agent == "srv:1" and hello.epoch == 5
            hellos.add(hello.rank)
            await daemon.send(p.Welcome(hello.rank, 5, "d1", "tcp://127.0.0.1:1", 0.5))
        await daemon.send(dispatch("ok", rank="srv:1/1", sampling=p.SamplingParams(max_new_tokens=5)))
        await daemon.send(dispatch("quiet", rank="srv:1/1", sampling=p.SamplingParams(max_new_tokens=5),
                                   stream=False))
        await daemon.send(dispatch("bad", rank="srv:1/0", slo=p.SloSpec(slo_class="no-such-class")))
        await daemon.send(dispatch("refused", rank="srv:1/0", slo=p.SloSpec(slo_class="tight")))
        await daemon.send(dispatch("slow", rank="srv:1/0", sampling=p.SamplingParams(max_new_tokens=50),
                                   slo=p.SloSpec(slo_class="relaxed")))
        while len(done) < 5:
            message = await daemon.recv()
            if isinstance(message, p.Output):
                outputs.setdefault(message.request_id, []).append(message)
                if message.request_id == "slow" and len(outputs["slow"]) == 1:
                    await daemon.send(p.Abort("srv:1/0", 5, "slow"))
            elif isinstance(message, p.Done):
                assert message.request_id not in done, "two Done for one request"
                done[message.request_id] = message
    finally:
        await agent.close(goodbye=False)
        await asyncio.wait_for(task, 5)
        daemon.close()
    return {"done": done, "outputs": outputs, "tm": tm}


def test_the_ingress_hands_the_coalescing_window_to_its_rank_agent() -> None:
    from types import SimpleNamespace

    async def scenario() -> None:
        daemon = ScriptedDaemon()
        env = {cpa.CONTROLPLANE_ENV: daemon.address, cpa.REPORTS_ENV: "tcp://127.0.0.1:1",
               cpa.RANK_NAME_ENV: "srv", cpa.COALESCE_ENV: "7"}
        settings = cpa.settings_from_environment(env, fairbatching_on=True)
        tm = FakeTokenizerManager()
        tm.server_args = SimpleNamespace(host="127.0.0.1", port=30000, dp_size=1, tokenizer_worker_num=1,
                                         enable_dp_attention=False, load_balance_method="round_robin")
        tm.asyncio_tasks = set()
        ingress = cpa.ControlPlaneIngress(tm, settings)
        try:
            ingress.start()
            assert ingress.agent.coalesce_s == pytest.approx(0.007)
            hello = await daemon.recv()  # the agent runs with it
            assert isinstance(hello, p.Hello) and hello.rank == "srv/0"
        finally:
            ingress.stop()
            if ingress.task is not None:
                await asyncio.wait_for(ingress.task, 5)
            daemon.close()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def engine_scenario() -> dict[str, Any]:
    return asyncio.run(_run_engine_scenario())


def test_an_unstreamed_dispatch_is_not_streamed_in_sglang_and_crosses_once_in_its_done(
        engine_scenario) -> None:
    quiet = next(obj for obj in engine_scenario["tm"].requests if obj.rid == "quiet")
    assert quiet.stream is False
    assert "quiet" not in engine_scenario["outputs"]
    done = engine_scenario["done"]["quiet"]
    assert (done.token_ids, done.text, done.completion_tokens) == ([100, 101, 102, 103, 104], "wxyza", 5)


def test_engine_streams_deltas_and_one_done(engine_scenario) -> None:
    outputs, done = engine_scenario["outputs"]["ok"], engine_scenario["done"]["ok"]
    assert [t for o in outputs for t in o.token_ids] == [100, 101, 102, 103, 104]
    assert "".join(o.text for o in outputs) == "wxyza"
    assert [o.completion_tokens for o in outputs] == [1, 2, 3, 4, 5]
    assert all(o.rank == "srv:1/1" and o.epoch == 5 for o in outputs)
    assert done.reason == p.FinishReason.LENGTH and not done.invalid
    assert (done.prompt_tokens, done.completion_tokens) == (4, 5)
    assert done.ttft_s is not None and done.latency_s is not None and 0 <= done.ttft_s <= done.latency_s
    obj = next(r for r in engine_scenario["tm"].requests if r.rid == "ok")
    assert obj.routed_dp_rank == 1 and obj.stream


def test_sglang_value_errors_and_400_aborts_are_invalid(engine_scenario) -> None:
    bad = engine_scenario["done"]["bad"]
    assert bad.invalid and bad.reason == p.FinishReason.ERROR and "no-such-class" in bad.error
    assert "bad" not in engine_scenario["outputs"]
    refused = engine_scenario["done"]["refused"]
    assert refused.invalid and refused.error == "input too long"


def test_abort_reaches_the_tokenizer_manager_and_ends_cancelled(engine_scenario) -> None:
    slow = engine_scenario["done"]["slow"]
    assert slow.reason == p.FinishReason.CANCELLED
    assert 1 <= slow.completion_tokens < 50
    assert engine_scenario["tm"].aborted == ["slow"]


# --------------------------------------------------------------------- scheduler reports
def _fake_scheduler(pab: int = 777, seq: int = 9) -> Any:
    from types import SimpleNamespace as NS

    from sglang_ext.policy.slo import Slo

    a, b, c, d, e = (NS(seqlen=0) for _ in range(5))
    stats = NS(get_kv_token_stats=lambda: (100, 0.1))
    classes = {"interactive": Slo(0.5, 0.03), "standard": Slo(2.0, 0.05)}
    echoes = {0: seq, 1: 3}
    return NS(
        fairbatching=NS(pab_tokens=pab, controlplane_echo=echoes.get, echoes=echoes, parked=NS(reqs=[c]),
                        class_budgets={"interactive": -40, "standard": 700},
                        config=NS(catalog=NS(classes=classes))),
        running_batch=NS(reqs=[a, b]),
        cur_batch_for_debug=NS(reqs=[b, d]),  # a mixed batch: b decodes, d's prefill was admitted
        chunked_req=e,
        waiting_queue=[NS(seqlen=10), NS(seqlen=5)],
        pool_stats_observer=NS(get_pool_stats=lambda: stats),
        max_total_num_tokens=1000,
    )


def test_a_schedulers_load_counts_parked_admitted_and_chunked_requests_as_running() -> None:
    from sglang_ext.adapter.scheduler.controlplane_reports import RankLoad, load_of

    assert load_of(_fake_scheduler()) == RankLoad(pab_tokens=777, running=5, waiting=2,
                                                  total_tokens=115, free_kv_tokens=900,
                                                  echoed_dispatch_seqs=(9,),
                                                  class_budgets=(("interactive", -40), ("standard", 700)))
    assert load_of(_fake_scheduler(), daemons=2).echoed_dispatch_seqs == (9, 3)


def test_each_daemon_gets_the_same_load_with_its_own_echo() -> None:
    import time

    from controlplane.reporter import ReportPublisher, ReportThrottle
    from sglang_ext.adapter.scheduler.controlplane_reports import SchedulerReports

    context = zmq.Context()
    pulls = [context.socket(zmq.PULL) for _ in range(2)]
    ports = [pull.bind_to_random_port("tcp://127.0.0.1") for pull in pulls]
    publishers = [ReportPublisher(f"tcp://127.0.0.1:{port}", "srv:1/0", 42, context=context)
                  for port in ports]
    reports = SchedulerReports(publishers, ReportThrottle(interval_s=10.0, min_gap_s=0.0))
    try:
        channel = p.report_channel()
        deadline = time.monotonic() + 30.0
        for publisher, pull in zip(publishers, pulls):  # connected: see the test below
            while not (publisher.publish(0, 0, 0, 0, 0, 0, 0.0) and pull.poll(100)):
                assert time.monotonic() < deadline, "a publisher never connected"
            while pull.poll(100):
                pull.recv()
        reports.maybe_publish(_fake_scheduler())
        (first,), (second,) = ([channel.decode(pull.recv())] for pull in pulls if pull.poll(5000))
        assert (first.echoed_dispatch_seq, second.echoed_dispatch_seq) == (9, 3)
        assert (first.pab_tokens, first.running, first.class_budgets) == \
            (second.pab_tokens, second.running, second.class_budgets)
    finally:
        reports.close()
        for pull in pulls:
            pull.close(linger=0)
        context.term()


def test_reports_are_numbered_throttled_and_carry_the_step_time() -> None:
    import time
    from types import SimpleNamespace as NS

    from controlplane.reporter import ReportPublisher, ReportThrottle
    from sglang_ext.adapter.scheduler.controlplane_reports import SchedulerReports

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        publisher = ReportPublisher(f"tcp://127.0.0.1:{port}", "srv:1/0", 42, context=context)
        reports = SchedulerReports(publisher, ReportThrottle(interval_s=10.0, min_gap_s=0.0))
        channel = p.report_channel()
        # IMMEDIATE: reports are queued only once connected (dropped before, still
        # numbered). Wait for that state: probe until one arrives.
        deadline = time.monotonic() + 30.0
        while not (publisher.publish(0, 0, 0, 0, 0, 0, 0.0) and pull.poll(100)):
            assert time.monotonic() < deadline, "the publisher never connected"
        while pull.poll(100):
            pull.recv()
        probes = publisher.seq
        reports.observe_step(NS(launched_at=1.0), 1.025)
        reports.observe_step(NS(launched_at=1.010), 1.045)  # launched ahead: ran from 1.025
        scheduler = _fake_scheduler()
        reports.maybe_publish(scheduler)
        reports.maybe_publish(scheduler)  # unchanged, inside the interval: not sent
        scheduler.fairbatching.echoes[0] = 10
        reports.maybe_publish(scheduler)
        received = []
        while pull.poll(1000):
            received.append(channel.decode(pull.recv()))
        assert [(r.seq, r.echoed_dispatch_seq) for r in received] == [(probes + 1, 9), (probes + 2, 10)]
        first = received[0]
        assert (first.rank, first.epoch, first.pab_tokens, first.running, first.waiting,
                first.total_tokens, first.free_kv_tokens) == ("srv:1/0", 42, 777.0, 5, 2, 115, 900)
        assert first.class_budgets == {"interactive": p.ClassBudget(0.5, -40.0),
                                       "standard": p.ClassBudget(2.0, 700.0)}
        assert first.step_time_s == pytest.approx(0.020)
        reports.close()
    finally:
        pull.close(linger=0)
        context.term()


def test_a_failed_report_is_counted_with_the_schedulers_errors_and_logged_rate_limited(caplog) -> None:
    import logging
    from types import SimpleNamespace as NS

    from controlplane.reporter import ReportThrottle
    from sglang_ext.adapter.scheduler.controlplane_reports import REPORT_FAILED_SITE, SchedulerReports
    from sglang_ext.adapter.scheduler.state import HandledErrors

    published = []
    errors = HandledErrors()  # the scheduler's FairBatchingState.errors
    reports = SchedulerReports(NS(publish=lambda *load: published.append(load)),
                               ReportThrottle(interval_s=10.0, min_gap_s=0.0), errors=errors)
    scheduler = _fake_scheduler()
    scheduler.pool_stats_observer = None  # a broken load read is counted and logged, never raised
    with caplog.at_level(logging.WARNING, logger="sglang_ext.fairbatching"):
        for _ in range(3):
            reports.maybe_publish(scheduler)
    assert reports.failures == 3 and errors.counts == {REPORT_FAILED_SITE: 3}
    lines = [r for r in caplog.records if r.name == "sglang_ext.fairbatching"]
    assert len(lines) == 1  # then at most once a minute, with the number left out
    assert "load report failed" in lines[0].getMessage() and lines[0].exc_info is not None
    assert "get_pool_stats" in str(lines[0].exc_info[1])
    scheduler.pool_stats_observer = _fake_scheduler().pool_stats_observer
    reports.maybe_publish(scheduler)
    assert len(published) == 1 and reports.failures == 3


class FakeClock:
    """``time.monotonic`` in whole milliseconds, advanced only by :class:`FakePoller`."""

    def __init__(self) -> None:
        self.ms = 1_000_000

    def monotonic(self) -> float:
        return self.ms / 1000


class FakePoller:
    """A ``zmq.Poller`` on a fake clock: each poll waits out its timeout (plus
    ``overshoot_ms``, a busy machine waking it late) unless a socket is readable by then."""

    def __init__(self, clock: FakeClock, overshoot_ms: int = 0) -> None:
        self.clock = clock
        self.overshoot_ms = overshoot_ms
        self.readable_at_ms: int | None = None
        self.waits: list[int] = []
        self.registered: list[tuple[object, int]] = []

    def poll(self, timeout_ms: int) -> list:
        self.waits.append(timeout_ms)
        wake = self.clock.ms + timeout_ms + self.overshoot_ms
        if self.readable_at_ms is not None and self.readable_at_ms <= wake:
            self.clock.ms = max(self.clock.ms, self.readable_at_ms)
            return [("socket", zmq.POLLIN)]
        self.clock.ms = wake
        return []

    def register(self, socket: object, flags: int) -> None:
        self.registered.append((socket, flags))


def test_the_idle_sleepers_wait_is_sliced_with_reports_and_still_wakes_for_requests(monkeypatch) -> None:
    from types import SimpleNamespace as NS

    from sglang_ext.adapter.scheduler import controlplane_reports as cpr

    clock = FakeClock()
    monkeypatch.setattr(cpr, "time", NS(monotonic=clock.monotonic))
    poller = FakePoller(clock)
    ticks: list[int] = []
    wrapped = cpr.ReportingPoller(poller, lambda: ticks.append(clock.ms), slice_s=0.05)
    start = clock.ms
    assert wrapped.poll(300) == []
    assert poller.waits == [50] * 6  # the wait, cut into slices
    assert ticks == [start + 50 * i for i in range(6)]  # a report before each slice
    assert clock.ms == start + 300  # and not a millisecond short

    poller.waits.clear(), ticks.clear()
    poller.readable_at_ms = clock.ms + 120  # a request arrives inside the third slice
    assert wrapped.poll(1000) == [("socket", zmq.POLLIN)]
    assert poller.waits == [50, 50, 50] and len(ticks) == 3 and clock.ms == poller.readable_at_ms

    poller.readable_at_ms = None
    late = FakePoller(clock, overshoot_ms=30)  # every wake 30 ms late: fewer slices, same wait
    wrapped = cpr.ReportingPoller(late, lambda: ticks.append(clock.ms), slice_s=0.05)
    start = clock.ms
    assert wrapped.poll(300) == []
    assert late.waits == [50, 50, 50, 50] and clock.ms == start + 320

    wrapped.register("push", zmq.POLLOUT)  # everything else is the poller's own
    assert late.registered == [("push", zmq.POLLOUT)]


def test_the_sliced_wait_on_a_real_poller_waits_its_timeout_and_wakes_for_a_request() -> None:
    """Bounds that hold on any machine: a wait never ends early (a busy machine only
    makes it later), and a readable socket ends a 10 s wait long before it runs out."""
    import time

    from sglang_ext.adapter.scheduler.controlplane_reports import ReportingPoller

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        ticks = []
        wrapped = ReportingPoller(poller, lambda: ticks.append(time.monotonic()), slice_s=0.05)
        started = time.monotonic()
        assert wrapped.poll(300) == []
        assert time.monotonic() - started >= 0.3 and ticks
        push.send(b"request")
        started = time.monotonic()
        assert wrapped.poll(10_000)  # readable: long before the timeout
        assert time.monotonic() - started < 5.0
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()


def test_a_scheduler_that_routes_on_class_budgets_computes_them_whatever_its_admission_mode() -> None:
    from types import SimpleNamespace as NS

    from sglang_ext.adapter.extension_config import ExtensionConfig
    from sglang_ext.policy.admission import AdmissionMode
    from sglang_ext.adapter.scheduler.hooks import attach

    config = ExtensionConfig.load(REPO / "configs" / "fairbatching.toml")
    plain = attach(NS(server_args=NS(load_balance_method="round_robin")), config)
    routed = attach(NS(server_args=NS(load_balance_method="pab")), config)
    assert plain.admission.mode is AdmissionMode.DEFER and not plain.publishes_budgets
    assert routed.publishes_budgets
    plain.update_budgets([], 0.0)
    routed.update_budgets([], 0.0)
    assert plain.class_budgets == {} and set(routed.class_budgets) == set(config.catalog.classes)


# --------------------------------------------------------------------- chat
def test_a_model_without_a_chat_template_is_refused_saying_so(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from sglang.srt.parser.template_manager import TemplateManager
    from transformers import AutoTokenizer

    from sglang_ext.adapter.emulated_gpu.tiny_model import write_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path / "model"))
    manager = TemplateManager()
    assert cpa.has_chat_template(manager, tokenizer)
    tokenizer.chat_template = None
    assert not cpa.has_chat_template(manager, tokenizer)
    server = SimpleNamespace(template_manager=manager, tokenizer_manager=SimpleNamespace(tokenizer=tokenizer))
    chat = dispatch(prompt=p.Prompt(messages=[p.ChatMessage("user", "hi")]))
    with pytest.raises(ValueError, match="the model has no chat template .*--chat-template"):
        cpa.chat_request_input(chat, server, 0, 1)

"""The emulated GPU's parts without a server: settings, device timeline, step log, batch
shapes (SGLang's ForwardMode and ScheduleBatch field conventions), token choice, request
refusal on SGLang's own request objects, and hook registration."""

from __future__ import annotations

import importlib.util
import itertools
import json
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

pytestmark = pytest.mark.sglang

import torch

from sglang_ext.adapter import emulated_gpu
from sglang_ext.adapter.emulated_gpu.device import EmulatedDevice
from sglang_ext.adapter.emulated_gpu.model_runner import resolve_max_running_requests
from sglang_ext.adapter.emulated_gpu.settings import (
    ENV_LOG,
    ENV_PROFILE,
    ENV_SEED,
    ENV_TIME_SCALE,
    EmulatedGpuConfigError,
    EmulationSettings,
)
from sglang_ext.adapter.batch_shape import BatchShape, batch_shape
from sglang_ext.adapter.emulated_gpu.timeline import (
    DeviceDeadline,
    DeviceTimeline,
    StepLog,
    StepRecord,
)
from sglang_ext.adapter.emulated_gpu.tokens import TokenPicker
from sglang_ext.adapter.emulated_gpu.validation import (
    reject_unsupported_request,
    unsupported_features,
)
from sglang_ext.sim.gpu import RooflineGpu, StepShape
from sglang_ext.sim.profile import PROFILES_DIR

PROFILE = "llama3.1-8b-h100"


def settings(**env: str) -> EmulationSettings:
    return EmulationSettings.from_environment(PROFILE, env)


# ------------------------------------------------------------------------------ settings
def test_bundled_profile_by_name_and_by_path():
    by_name = settings()
    by_path = EmulationSettings.from_environment(str(PROFILES_DIR / f"{PROFILE}.toml"), {})
    assert by_name.profile == by_path.profile
    assert by_name.profile.name == PROFILE
    assert (by_name.time_scale, by_name.seed, by_name.log_path) == (1.0, 0, None)


def test_optional_variables_are_read(tmp_path):
    s = settings(**{ENV_TIME_SCALE: "2.5", ENV_SEED: "7", ENV_LOG: str(tmp_path / "s.jsonl")})
    assert (s.time_scale, s.seed, s.log_path) == (2.5, 7, tmp_path / "s.jsonl")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("no-such-gpu", "no bundled profile named 'no-such-gpu'"),
        ("", "empty"),
        ("/nonexistent/gpu.toml", "no such profile file"),
    ],
)
def test_bad_profile_names_the_variable(spec, fragment):
    with pytest.raises(EmulatedGpuConfigError) as info:
        EmulationSettings.from_environment(spec, {})
    assert str(info.value).startswith(f"{ENV_PROFILE}={spec!r}")
    assert fragment in str(info.value)


def test_invalid_profile_file_names_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    text = (PROFILES_DIR / f"{PROFILE}.toml").read_text().replace("num_layers = 32", "")
    bad.write_text(text)
    with pytest.raises(EmulatedGpuConfigError, match="missing field model.num_layers"):
        EmulationSettings.from_environment(str(bad), {})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        (ENV_TIME_SCALE, "fast"),
        (ENV_TIME_SCALE, "0"),
        (ENV_TIME_SCALE, "-1"),
        (ENV_TIME_SCALE, "inf"),
        (ENV_TIME_SCALE, "nan"),
        (ENV_SEED, "1.5"),
        (ENV_SEED, "-3"),
        (ENV_LOG, "/nonexistent-dir/steps.jsonl"),
    ],
)
def test_bad_optional_value_names_the_variable(variable, value):
    with pytest.raises(EmulatedGpuConfigError) as info:
        settings(**{variable: value})
    assert str(info.value).startswith(f"{variable}={value!r}")


def test_log_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(EmulatedGpuConfigError, match="is a directory"):
        settings(**{ENV_LOG: str(tmp_path)})


# ------------------------------------------------------------------------------ timeline
def test_timeline_runs_one_step_at_a_time():
    timeline = DeviceTimeline()
    assert timeline.schedule(10.0, 0.5) == (10.0, 10.5)
    assert timeline.schedule(10.1, 0.5) == (10.5, 11.0)  # launched early: queued
    assert timeline.schedule(12.0, 0.25) == (12.0, 12.25)  # launched late: device idled
    with pytest.raises(ValueError):
        timeline.schedule(13.0, -1.0)


def test_device_deadline_completes_at_its_deadline():
    deadline = DeviceDeadline(time.monotonic() + 0.03)
    assert not deadline.query()
    deadline.record()
    deadline.synchronize()
    assert time.monotonic() >= deadline.deadline
    assert deadline.query()


def record(i: int) -> StepRecord:
    return StepRecord(
        launch=float(i), start=float(i), end=i + 0.5, mode="decode", new_tokens=2,
        context=100 + i, num_reqs=2, prefill_tokens=0, prefill_reqs=0, decode_reqs=2,
        seq_lens_sum=102 + i,
    )  # fmt: skip


def test_step_log_keeps_a_bounded_ring_and_appends_json_lines(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(capacity=3, path=path)
    for i in range(5):
        log.append(record(i))
    assert [r.launch for r in log.recent()] == [2.0, 3.0, 4.0]
    assert StepLog.read(path) == [record(i) for i in range(5)]  # readable before close
    log.close()
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) >= {"start", "end", "new_tokens", "context", "num_reqs"}


def test_step_log_path_gets_the_pid_only_with_several_processes(tmp_path):
    path = tmp_path / "steps.jsonl"
    assert StepLog.per_process_path(path, several_processes=False) == path
    suffixed = StepLog.per_process_path(path, several_processes=True)
    assert suffixed.parent == tmp_path and suffixed.name.startswith("steps.jsonl.")
    assert suffixed.name.rsplit(".", 1)[1].isdigit()


# ------------------------------------------------------------------------------ device
def decode_shape(context_lens: list[int]) -> BatchShape:
    step = StepShape.from_requests(decode_context_lens=context_lens)
    return BatchShape("decode", step, len(context_lens), sum(context_lens) + len(context_lens))


def test_device_charges_the_profiles_step_time_scaled():
    s = settings(**{ENV_TIME_SCALE: "3", ENV_SEED: "5"})
    device = EmulatedDevice(s, seed=5, log=StepLog())
    reference = RooflineGpu(s.profile, seed=5)
    shapes = [decode_shape([100, 200]), decode_shape([300] * 8), decode_shape([50])]
    now = 1000.0
    for shape in shapes:
        step = device.launch(shape, now=now)
        assert step.duration == pytest.approx(3 * reference.measure_step_s(shape.step))
        assert (step.new_tokens, step.context, step.num_reqs) == (
            shape.step.new_tokens, shape.step.total_context, shape.num_reqs,
        )  # fmt: skip
        now += 0.001  # launched while the previous step still runs
    steps = device.log.recent()
    assert all(b.start == a.end for a, b in itertools.pairwise(steps))


def test_device_with_a_service_curve_profile_charges_that_curve():
    s = EmulationSettings.from_environment("des-study", {ENV_TIME_SCALE: "2"})
    service = s.profile.service
    device = EmulatedDevice(s, seed=0, log=StepLog())
    for contexts in ([100] * 8, [100] * 100):
        tokens = len(contexts)
        expected_s = (service.setup_ms / 1e3
                      + service.per_token_us / 1e6 * max(0, tokens - service.threshold_tokens))
        assert device.step_seconds(decode_shape(contexts)) == pytest.approx(2 * expected_s)


def test_device_step_without_tokens_takes_no_time():
    device = EmulatedDevice(settings(), seed=0, log=StepLog())
    idle = BatchShape("idle", StepShape(0, 0.0, 0, 0, 0, 0), 0, 0)
    step = device.launch(idle, now=5.0)
    assert (step.start, step.end) == (5.0, 5.0)


# ------------------------------------------------------------------------------ shapes
@pytest.fixture(scope="module")
def forward_mode():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode


def req(prompt_len: int) -> SimpleNamespace:
    return SimpleNamespace(origin_input_ids=list(range(prompt_len)))


def test_decode_batch_reads_each_requests_kv_before_its_new_token(forward_mode):
    # After prepare_for_decode, seq_lens counts the token being computed.
    batch = SimpleNamespace(
        forward_mode=forward_mode.DECODE,
        reqs=[req(10), req(20)],
        seq_lens_cpu=torch.tensor([15, 31]),
    )
    shape = batch_shape(batch)
    assert shape.mode == "decode"
    assert shape.step == StepShape.from_requests(decode_context_lens=[14, 30])
    assert (shape.num_reqs, shape.seq_lens_sum) == (2, 46)


def test_extend_batch_is_prefill_chunks_after_their_prefix(forward_mode):
    batch = SimpleNamespace(
        forward_mode=forward_mode.EXTEND,
        reqs=[req(100), req(40), req(5)],
        extend_lens=[64, 40, 1],
        prefix_lens=[0, 0, 4],  # the last: a 1-token final chunk after a cached prefix
        seq_lens_cpu=torch.tensor([64, 40, 5]),
    )
    shape = batch_shape(batch)
    assert shape.step == StepShape.from_requests(prefill_chunks=[(64, 0), (40, 0), (1, 4)])
    assert shape.step.new_tokens == sum(batch.extend_lens)


def test_mixed_batch_counts_its_appended_decodes_as_decodes(forward_mode):
    # mix_with_running appends the running decodes as 1-token extends, prefix = seq_len - 1.
    batch = SimpleNamespace(
        forward_mode=forward_mode.MIXED,
        reqs=[req(300), req(12), req(7)],
        extend_lens=[128, 1, 1],
        prefix_lens=[64, 20, 9],
        seq_lens_cpu=torch.tensor([192, 21, 10]),
    )
    shape = batch_shape(batch)
    assert shape.mode == "mixed"
    assert shape.step == StepShape.from_requests(
        prefill_chunks=[(128, 64)], decode_context_lens=[20, 9]
    )
    assert shape.step.new_tokens == sum(batch.extend_lens)
    assert shape.seq_lens_sum == 223


def test_idle_batch_has_no_work(forward_mode):
    batch = SimpleNamespace(
        forward_mode=forward_mode.IDLE, reqs=[], seq_lens_cpu=torch.empty(0, dtype=torch.int64)
    )
    shape = batch_shape(batch)
    assert shape.step.new_tokens == 0 and shape.num_reqs == 0


# ------------------------------------------------------------------------------ tokens
def test_token_picker_prefers_the_given_id_and_avoids_stop_ids():
    assert TokenPicker(1000, stop_ids={0, 1}, preferred=[275]).default == 275
    assert TokenPicker(1000, stop_ids={275}, preferred=[275]).default == 500
    assert TokenPicker(1000, stop_ids={500, 501}).default == 502
    assert TokenPicker(10, stop_ids=set(range(5, 10))).default == 0


def test_token_picker_repicks_only_for_requests_that_stop_on_the_default():
    picker = TokenPicker(1000, stop_ids={1}, preferred=[275])
    assert picker.for_request(None, {1, 2}) == 275
    assert picker.for_request({275}, None) == 500
    assert picker.for_request({275}, {500}) == 501
    with pytest.raises(ValueError):
        TokenPicker(3, stop_ids={0, 1, 2})


# ------------------------------------------------------------------------------ refusal
@pytest.fixture(scope="module")
def io_struct():
    from sglang.srt.managers import io_struct

    return io_struct


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"return_logprob": True}, "return_logprob"),
        ({"return_logprob": True, "top_logprobs_num": 3}, "return_logprob"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"return_hidden_states": "last"}, "return_hidden_states"),
        ({"image_data": "http://example.invalid/cat.png"}, "image_data"),
    ],
)
def test_requests_for_missing_outputs_are_refused(io_struct, fields, named):
    obj = io_struct.GenerateReqInput(text="hi", **fields)
    obj.normalize_batch_and_arguments()
    assert any(named in f for f in unsupported_features(obj))
    with pytest.raises(ValueError, match=named):
        reject_unsupported_request(obj)


def test_input_embeds_and_embedding_requests_are_refused(io_struct):
    embeds = io_struct.GenerateReqInput(input_embeds=[[0.0, 1.0]])
    assert "input_embeds" in unsupported_features(embeds)
    assert "embeddings" in unsupported_features(io_struct.EmbeddingReqInput(text="hi"))


def test_plain_requests_pass(io_struct):
    obj = io_struct.GenerateReqInput(
        text="hi", sampling_params={"max_new_tokens": 4}, stream=True, image_data=[]
    )
    obj.normalize_batch_and_arguments()
    assert unsupported_features(obj) == []
    reject_unsupported_request(obj)


# ------------------------------------------------------------------------------ sizing
def test_max_running_requests_follows_sglangs_rule():
    assert resolve_max_running_requests(400_000, 8192, None) == 4096
    assert resolve_max_running_requests(20_000, 8192, None) == 2048
    assert resolve_max_running_requests(3_000, 8192, None) == 1500
    assert resolve_max_running_requests(65_536, 8192, 64) == 64
    assert resolve_max_running_requests(100, 8192, 64) == 50
    assert resolve_max_running_requests(65_536, 8192, 64, attn_dp_size=2) == 32


# ------------------------------------------------------------------------------ hooks
@pytest.fixture
def hook_registry(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(emulated_gpu, "_installed", False)
    return HookRegistry


def test_install_registers_the_worker_refusal_and_dp_hooks(hook_registry, monkeypatch):
    monkeypatch.delenv(ENV_TIME_SCALE, raising=False)
    emulated_gpu.install_emulated_gpu(PROFILE)
    targets = {t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t in hook_registry._hooks}
    assert targets == {
        "Scheduler.init_tp_model_worker",
        "TokenizerManager._validate_one_request",
        "DataParallelController.event_loop",
    }
    emulated_gpu.install_emulated_gpu(PROFILE)  # idempotent
    assert sum(len(h) for h in hook_registry._hooks.values()) == 3


def test_install_with_a_bad_value_raises_and_leaves_a_refusing_worker(hook_registry, monkeypatch):
    monkeypatch.setenv(ENV_TIME_SCALE, "-2")
    with pytest.raises(EmulatedGpuConfigError, match=ENV_TIME_SCALE):
        emulated_gpu.install_emulated_gpu(PROFILE)
    ((target, hooks),) = hook_registry._hooks.items()
    assert target.endswith("Scheduler.init_tp_model_worker")
    ((_, refuse, _),) = hooks
    with pytest.raises(EmulatedGpuConfigError, match=ENV_TIME_SCALE):
        refuse(SimpleNamespace())


# ------------------------------------------------------------------------------ tiny model
def test_tiny_model_has_a_local_tokenizer_within_the_models_vocabulary(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from sglang_ext.adapter.emulated_gpu.tiny_model import EOS_TOKEN, write_tiny_model

    path = write_tiny_model(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 2
    assert len(tokenizer) <= config.vocab_size
    assert tokenizer.eos_token == EOS_TOKEN and config.eos_token_id == tokenizer.eos_token_id
    text = "The scheduler decides which requests join the next batch."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    again = write_tiny_model(tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()

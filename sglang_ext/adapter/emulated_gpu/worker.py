"""The TpModelWorker that runs every forward on the emulated GPU.

Overlap mode (SGLang's default): ``forward_batch_generation`` queues the step on the device
timeline and returns at once, like a CUDA launch; the result's ``copy_done`` (installed by
``copy_to_cpu``) completes when the emulated step ends, and SGLang's result processor waits
on it.  So the scheduler's CPU work for the next batch overlaps the current step, as on a GPU.
With ``--disable-overlap-schedule`` the forward itself sleeps until the step ends.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.runtime_context import get_parallel, get_schedule, get_spec

from sglang_ext.adapter.batch_shape import batch_shape

from .device import EmulatedDevice
from .model_runner import EmulatedModelRunner
from .settings import ENV_LOG, ENV_PROFILE, EmulatedGpuConfigError, EmulationSettings
from .timeline import DeviceDeadline, StepLog, sleep_until
from .tokens import TokenPicker

__all__ = ["EmulatedBatchResult", "EmulatedTpModelWorker"]

logger = logging.getLogger(__name__)

#: A common word whose first token id the emulator emits when the tokenizer has one.
_PREFERRED_TEXT = " the"


@dataclasses.dataclass
class EmulatedBatchResult(GenerationBatchResult):
    """A result whose device-to-host copy completes when its emulated step ends."""

    device_done_at: float = 0.0

    def copy_to_cpu(self, return_logprob: bool, return_hidden_states: bool = True) -> None:
        self.copy_done = DeviceDeadline(self.device_done_at)


class EmulatedTpModelWorker(TpModelWorker):
    """TpModelWorker over :class:`EmulatedModelRunner`, timing steps on an emulated GPU."""

    def __init__(self, *args: Any, settings: EmulationSettings, **kwargs: Any) -> None:
        self.settings = settings
        super().__init__(*args, **kwargs)
        self._check_supported()
        parallel = get_parallel()
        several = parallel.tp_size * parallel.pp_size * (parallel.num_dp_ranks or 1) > 1
        log_path = settings.log_path
        if log_path is not None:
            log_path = StepLog.per_process_path(log_path, several)
        try:
            log = StepLog(path=log_path)
        except OSError as exc:
            raise EmulatedGpuConfigError(
                f"{ENV_LOG}={str(settings.log_path)!r}: cannot open {str(log_path)!r}: {exc}"
            ) from None
        dp_rank = parallel.dp_rank or 0
        self.emulated_device = EmulatedDevice(settings, seed=settings.seed + dp_rank, log=log)
        self._picker = self._token_picker()
        self._sleep_in_forward = not self.enable_overlap
        logger.info(
            "Emulated GPU %s (%s), time scale %g, seed %d, overlap %s, emitted token %d%s",
            settings.profile.name,
            settings.profile_source,
            settings.time_scale,
            settings.seed + dp_rank,
            self.enable_overlap,
            self._picker.default,
            f", step log {log_path}" if log_path is not None else "",
        )

    @property
    def step_log(self) -> StepLog:
        return self.emulated_device.log

    def _init_model_runner(self) -> None:
        requested = get_schedule().max_total_tokens
        kv_tokens = requested if requested is not None else self.settings.profile.kv_capacity_tokens
        self._model_runner = EmulatedModelRunner(
            model_config=self.model_config,
            mem_fraction_static=get_schedule().mem_fraction_static,
            gpu_id=self.gpu_id,
            nccl_port=self.nccl_port,
            server_args=self.server_args,
            is_draft_worker=self.is_draft_worker,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            memory_pool_config=self.memory_pool_config,
            kv_pool_tokens=kv_tokens,
        )

    def _check_supported(self) -> None:
        unsupported = []
        if get_spec().speculative_algorithm is not None:
            unsupported.append("speculative decoding")
        if get_parallel().pp_size > 1:
            unsupported.append("pipeline parallelism (--pp-size > 1)")
        if not self.model_config.is_generation:
            unsupported.append("embedding / reward models")
        if self.model_config.is_multimodal:
            unsupported.append("multimodal models")
        if self.is_dllm():
            unsupported.append("diffusion LLM decoding")
        if unsupported:
            raise EmulatedGpuConfigError(
                f"{ENV_PROFILE} is set, but the emulated GPU does not support "
                f"{', '.join(unsupported)}; remove those options or unset {ENV_PROFILE}"
            )

    def _token_picker(self) -> TokenPicker:
        stop_ids = set(self.model_config.hf_eos_token_id or ())
        preferred: list[int] = []
        tokenizer = self.tokenizer
        if tokenizer is not None:
            for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
                value = getattr(tokenizer, attr, None)
                if isinstance(value, int):
                    stop_ids.add(value)
            stop_ids.update(getattr(tokenizer, "additional_stop_token_ids", None) or ())
            stop_ids.update(getattr(tokenizer, "all_special_ids", None) or ())
            preferred = list(tokenizer.encode(_PREFERRED_TEXT, add_special_tokens=False))[:1]
        return TokenPicker(self.model_config.vocab_size, stop_ids, preferred)

    def get_pad_input_ids_func(self):
        return None

    def forward_batch_generation(self, batch, forward_batch=None, *args: Any, **kwargs: Any):
        if batch is None:
            raise RuntimeError("the emulated GPU runs ScheduleBatch forwards only")
        shape = batch_shape(batch)
        step = self.emulated_device.launch(shape)
        result = EmulatedBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=self._next_token_ids(batch.reqs) if shape.num_reqs else None,
            can_run_cuda_graph=False,
            device_done_at=step.end,
        )
        if self._sleep_in_forward:
            sleep_until(step.end)
        return result

    def _next_token_ids(self, reqs: list) -> torch.Tensor:
        picker = self._picker
        default = picker.default
        ids = []
        for req in reqs:
            stop, eos = req.sampling_params.stop_token_ids, req.eos_token_ids
            if (stop and default in stop) or (eos and default in eos):
                ids.append(picker.for_request(stop, eos))
            else:
                ids.append(default)
        return torch.tensor(ids, dtype=torch.long)

    def forward_batch_embedding(self, batch):
        raise RuntimeError("the emulated GPU does not compute embeddings")

    def forward_batch_split_prefill(self, batch):
        raise RuntimeError("the emulated GPU does not support split prefill (PD multiplexing)")

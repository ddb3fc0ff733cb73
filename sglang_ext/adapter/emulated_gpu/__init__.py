"""Emulated GPU: run the stock SGLang server on a CPU machine with modelled step times.

An evaluation and testing tool, switched on only by ``FAIRBATCHING_EMULATED_GPU=<profile>``.
:func:`install_emulated_gpu` registers SGLang plugin hooks that

* replace the scheduler's model worker with :class:`~.worker.EmulatedTpModelWorker`: no
  weights, no KV tensors, each forward charged the profile's roofline step time
  (``sglang_ext.sim.gpu.RooflineGpu``) on an emulated device timeline;
* refuse, with HTTP 400, requests for outputs it cannot produce (logprobs, hidden states,
  embeddings, multimodal input) -- :mod:`.validation`;
* make the data-parallel controller block instead of spinning (:mod:`.dp`).

Importing this package imports neither sglang nor torch; the hooks import them when run.
"""

from __future__ import annotations

import os
from typing import Any

from .settings import EmulatedGpuConfigError, EmulationSettings

__all__ = ["EmulatedGpuConfigError", "EmulationSettings", "install_emulated_gpu"]

_SCHEDULER_INIT_WORKER = "sglang.srt.managers.scheduler.Scheduler.init_tp_model_worker"
_VALIDATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_DP_EVENT_LOOP = "sglang.srt.managers.data_parallel_controller.DataParallelController.event_loop"

_installed = False


def install_emulated_gpu(spec: str) -> None:
    """Register the emulated GPU's SGLang hooks for profile ``spec`` (name or TOML path).

    Reads the optional ``FAIRBATCHING_EMULATED_GPU_*`` variables.  On a bad value it raises
    :class:`EmulatedGpuConfigError`, after registering a model-worker hook that raises the
    same error, so the server stops at start-up with that message instead of loading a real
    model (SGLang's plugin loader only logs an exception from a plugin).
    """
    global _installed
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if _installed:
        return
    try:
        settings = EmulationSettings.from_environment(spec, os.environ)
    except EmulatedGpuConfigError as error:
        HookRegistry.register(_SCHEDULER_INIT_WORKER, _refuse(error), HookType.REPLACE)
        _installed = True
        raise
    HookRegistry.register(_SCHEDULER_INIT_WORKER, _worker_factory(settings), HookType.REPLACE)
    HookRegistry.register(_VALIDATE_REQUEST, _validate_request, HookType.BEFORE)
    HookRegistry.register(_DP_EVENT_LOOP, _dp_event_loop, HookType.REPLACE)
    _installed = True


def _worker_factory(settings: EmulationSettings):
    def init_tp_model_worker(scheduler: Any) -> None:
        from sglang.srt.runtime_context import get_device

        from .worker import EmulatedTpModelWorker

        scheduler.tp_worker = EmulatedTpModelWorker(
            server_args=scheduler.server_args,
            gpu_id=get_device().gpu_id,
            nccl_port=scheduler.nccl_port,
            settings=settings,
        )

    return init_tp_model_worker


def _refuse(error: EmulatedGpuConfigError):
    def init_tp_model_worker(scheduler: Any) -> None:
        raise EmulatedGpuConfigError(str(error))

    return init_tp_model_worker


def _validate_request(tokenizer_manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    from .validation import reject_unsupported_request

    reject_unsupported_request(obj)


def _dp_event_loop(controller: Any) -> None:
    from .dp import blocking_event_loop

    blocking_event_loop(controller)

"""Reject a malformed per-request SLO, or one no rank can honour, at SGLang's front door
(HTTP 400 with the reason) instead of letting it reach a scheduler. Runs in the HTTP /
TokenizerManager process.

"Cannot honour" is a TPOT below twice the smallest step (one decode token) predicted by
the *initial* step model of the extension's config, the one this process has
(``batch_former.unserviceable_slo_reason``). The schedulers' online models may drift
from it; the batch former applies the same floor with its learned model, so a request
the door let through that the rank then cannot serve is served best-effort without
setting anyone's time budget."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.policy.batch_former import unserviceable_slo_reason
from sglang_ext.policy.slo import SloCatalog, SloError
from sglang_ext.policy.step_model import StepPredictor

VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def check_request_slo(
    catalog: SloCatalog, sampling_params: Any, step_model: StepPredictor | None = None
) -> None:
    """Raise ``ValueError`` (SGLang answers 400) if a request's ``custom_params.slo`` is
    malformed, names an unknown class, or (given the initial ``step_model``) asks for a
    TPOT below the rank's floor."""
    params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for params in params_list:
        if not isinstance(params, Mapping):
            continue
        try:
            slo = catalog.resolve_custom_params(params.get("custom_params"))
        except SloError as exc:
            raise ValueError(f"invalid SLO in custom_params: {exc}") from None
        reason = None if step_model is None else unserviceable_slo_reason(slo, step_model)
        if reason is not None:
            raise ValueError(f"unserviceable SLO in custom_params: {reason}")


def install_request_validation(
    catalog: SloCatalog, step_model: StepPredictor | None = None
) -> None:
    def before_validate(self: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
        check_request_slo(catalog, getattr(obj, "sampling_params", None), step_model)

    HookRegistry.register(VALIDATE_TARGET, before_validate, HookType.BEFORE)

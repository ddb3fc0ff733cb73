"""Reject a malformed per-request SLO at SGLang's front door (HTTP 400 with the reason)
instead of letting it reach a scheduler. Runs in the HTTP / TokenizerManager process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.policy.slo import SloCatalog, SloError

VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def check_request_slo(catalog: SloCatalog, sampling_params: Any) -> None:
    """Raise ``ValueError`` (SGLang answers 400) if a request's ``custom_params.slo`` is
    malformed or names an unknown class."""
    params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for params in params_list:
        if not isinstance(params, Mapping):
            continue
        try:
            catalog.resolve_custom_params(params.get("custom_params"))
        except SloError as exc:
            raise ValueError(f"invalid SLO in custom_params: {exc}") from None


def install_request_validation(catalog: SloCatalog) -> None:
    def before_validate(self: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
        check_request_slo(catalog, getattr(obj, "sampling_params", None))

    HookRegistry.register(VALIDATE_TARGET, before_validate, HookType.BEFORE)

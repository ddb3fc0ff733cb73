"""Reject a malformed per-request SLO, or one no rank can honour, at SGLang's front door
(HTTP 400 with the reason) instead of letting it reach a scheduler. Runs in the HTTP /
TokenizerManager process.

"Cannot honour" is a TPOT below twice the smallest step (one decode token) predicted by
the *initial* step model of the extension's config, the one this process has
(``batch_former.unserviceable_slo_reason``). A scheduler that calibrated its step model at
start-up judges each request again with the fitted model on first sight and ends one it
cannot serve with the same 400 (``sglang_ext.adapter.scheduler.requests``); the online
models' later drift never re-labels an admitted request.

An end-to-end SLO (``e2e_ms``) is judged on the envelope the scheduler will give it
(``sglang_ext.adapter.scheduler.requests``): paced for the request's output bound as SGLang sees
it here (:class:`OutputBound`), and refused in the request's own terms: the ``e2e_ms``
it would need, or the ``max_new_tokens`` its ``e2e_ms`` covers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_ext.policy.batch_former import (
    MIN_TPOT_STEP_MULTIPLE,
    min_serviceable_tpot_s,
    unserviceable_slo_reason,
)
from sglang_ext.policy.slo import E2E_TTFT_SHARE, Slo, SloCatalog, SloError
from sglang_ext.policy.step_model import StepPredictor

VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
#: what ``SamplingParams`` gives a request that states no ``max_new_tokens``
SGLANG_DEFAULT_MAX_NEW_TOKENS: int = next(
    field.default for field in msgspec.structs.fields(SamplingParams)
    if field.name == "max_new_tokens"
)


@dataclass(frozen=True, slots=True)
class OutputBound:
    """How many output tokens SGLang lets a request produce, as the door can tell:
    its ``max_new_tokens``; absent, ``default`` (``SamplingParams``' or the server's
    ``--preferred-sampling-params``'); ``None`` (OpenAI routes without ``max_tokens``),
    up to the context's ``room`` (its length less the prompt), to which any bound is cut
    as SGLang cuts it. ``room`` unknown (None): an unbounded request has no bound here."""

    default: int | None = SGLANG_DEFAULT_MAX_NEW_TOKENS
    room: int | None = None

    def of(self, params: Mapping[str, Any]) -> tuple[int, str] | None:
        """The bound and how to name it to the client; None when there is none (or it is
        not an integer, which SGLang refuses itself)."""
        stated = "max_new_tokens" in params
        value = params["max_new_tokens"] if stated else self.default
        if value is None:
            if self.room is None:
                return None
            return self.room, f"the context's room of {self.room} tokens (no max_new_tokens)"
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        if self.room is not None and value > self.room:
            return self.room, f"the context's room of {self.room} tokens"
        return value, f"max_new_tokens {value}" + ("" if stated else " (the default)")


def check_request_slo(
    catalog: SloCatalog, sampling_params: Any, step_model: StepPredictor | None = None,
    output: OutputBound = OutputBound(),
) -> None:
    """Raise ``ValueError`` (SGLang answers 400) if a request's ``custom_params.slo`` is
    malformed, names an unknown class, or (given the initial ``step_model``) asks for a
    TPOT below the rank's floor; an end-to-end SLO's TPOT is its envelope's, paced for
    the request's ``output`` bound."""
    params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for params in params_list:
        if not isinstance(params, Mapping):
            continue
        try:
            slo = catalog.resolve_custom_params(params.get("custom_params"))
        except SloError as exc:
            raise ValueError(f"invalid SLO in custom_params: {exc}") from None
        if step_model is None:
            continue
        if slo.is_end_to_end:
            reason = _e2e_refusal(slo, output.of(params), step_model)
        else:
            reason = unserviceable_slo_reason(slo, step_model)
        if reason is not None:
            raise ValueError(f"unserviceable SLO in custom_params: {reason}")


def _e2e_refusal(
    slo: Slo, bound: tuple[int, str] | None, step_model: StepPredictor
) -> str | None:
    """Why an e2e SLO paced for ``bound`` output tokens is refused, or None."""
    if bound is None or bound[0] < 1:
        return None
    tokens, named = bound
    if unserviceable_slo_reason(slo.with_expected_output(tokens), step_model) is None:
        return None
    floor_s = min_serviceable_tpot_s(step_model)
    e2e_s = slo.e2e_s
    paced_s = max(1, tokens - 1) * floor_s  # as Slo.with_expected_output paces them
    if math.isclose(slo.ttft_s, E2E_TTFT_SHARE * e2e_s):  # its first-token budget is e2e_ms's share
        needs = f"e2e_ms >= {math.ceil(paced_s / (1.0 - E2E_TTFT_SHARE) * 1e3)}"
    else:
        needed_ms = math.ceil((slo.ttft_s + paced_s) * 1e3)
        needs = f"e2e_ms >= {needed_ms} with ttft_ms {slo.ttft_s * 1e3:g}"
    covered = math.floor((e2e_s - slo.ttft_s) / floor_s) + 1
    fewer = f", or max_new_tokens <= {covered}" if covered >= 2 else ""
    return (
        f"e2e_ms {e2e_s * 1e3:g} cannot cover {named} at this server's minimum of "
        f"{floor_s * 1e3:.1f} ms per output token ({MIN_TPOT_STEP_MULTIPLE:g} x its smallest "
        f"step) after a first-token budget of {slo.ttft_s * 1e3:g} ms: it needs {needs}{fewer}"
    )


def output_bound(tokenizer_manager: Any, input_ids: Any) -> OutputBound:
    """What bounds a request's output on this ``TokenizerManager`` (see :class:`OutputBound`)."""
    preferred = getattr(tokenizer_manager, "preferred_sampling_params", None) or {}
    default = preferred.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    context_len = getattr(tokenizer_manager, "context_len", None)
    room = None
    if isinstance(context_len, int) and input_ids is not None:
        prompt = len(input_ids) + getattr(tokenizer_manager, "num_reserved_tokens", 0)
        room = max(0, context_len - prompt)
    return OutputBound(default, room)


def install_request_validation(
    catalog: SloCatalog, step_model: StepPredictor | None = None
) -> None:
    def before_validate(
        self: Any, obj: Any, input_ids: Any = None, *args: Any, **kwargs: Any
    ) -> None:
        check_request_slo(catalog, getattr(obj, "sampling_params", None), step_model,
                          output_bound(self, input_ids))

    HookRegistry.register(VALIDATE_TARGET, before_validate, HookType.BEFORE)

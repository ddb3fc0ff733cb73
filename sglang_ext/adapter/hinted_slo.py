"""SLO hints at SGLang's front door: a request that names no ``custom_params.slo`` gets the
SLO its hints name (OpenAI's ``service_tier``, SGLang's ``priority``, smg's
``x-smg-priority`` and llm-d's ``x-llm-d-slo-ttft-ms`` / ``-tpot-ms`` headers), read as the
control plane's gateway reads them (:mod:`controlplane.slo_hints`; the table is the
extension config's ``[slo_hints]``). Runs in the HTTP process; installed through
HookRegistry (one step of :mod:`sglang_ext.adapter.front_door`'s wrappers), no patch:

- ``http_server.serve_generate_request`` (around): ``/generate``, its ``priority`` and the
  headers, for every prompt of a batch;
- ``OpenAIServingBase.handle_request`` (around): the completion and chat routes, their
  ``priority``, ``service_tier`` (read from the body: SGLang's request models drop the
  field) and the headers.

The SLO is written where the extension reads it (``custom_params["slo"]``) before the
request is validated (:mod:`sglang_ext.adapter.admission.slo_validation`), so a hinted
SLO no rank can honour is refused as an explicit one is. A bad hint is a 400 naming the
field, before anything is tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from controlplane.slo_hints import HintError, SloHints

def with_hinted_slo(sampling_params: Mapping[str, Any] | None, hints: SloHints,
                    headers: Mapping[str, str], service_tier: str | None,
                    priority: int | None) -> dict[str, Any] | None:
    """``sampling_params`` with ``custom_params["slo"]`` set from the hints, a copy; None
    when it names an SLO already or the hints name none. Raises :class:`HintError`."""
    custom = (sampling_params or {}).get("custom_params")
    if isinstance(custom, Mapping) and custom.get("slo") is not None:
        return None
    spec = hints.slo(headers, service_tier, priority)
    if spec is None:
        return None
    custom = dict(custom) if isinstance(custom, Mapping) else {}
    custom["slo"] = spec.as_custom_params()
    return {**(sampling_params or {}), "custom_params": custom}


def hint_generate(obj: Any, hints: SloHints, headers: Mapping[str, str]) -> None:
    """A ``GenerateReqInput``'s sampling parameters, each prompt's, with its hinted SLO."""
    sampling, priority = obj.sampling_params, obj.priority
    if isinstance(sampling, list):
        priorities = priority if isinstance(priority, list) else [priority] * len(sampling)
        hinted = [with_hinted_slo(params, hints, headers, None, p) for params, p in zip(sampling, priorities)]
        if any(h is not None for h in hinted):
            obj.sampling_params = [h if h is not None else params for h, params in zip(hinted, sampling)]
        return
    hinted = with_hinted_slo(sampling, hints, headers, None, priority if isinstance(priority, int) else None)
    if hinted is not None:
        obj.sampling_params = hinted


async def hint_openai(request: Any, raw_request: Any, hints: SloHints) -> None:
    """A completion or chat request's ``custom_params`` with its hinted SLO."""
    if not hasattr(request, "custom_params"):
        return
    headers = raw_request.headers if raw_request is not None else {}
    tier = None
    if raw_request is not None:
        body = await raw_request.body()
        if b"service_tier" in body:
            try:
                tier = json.loads(body).get("service_tier")
            except (ValueError, AttributeError):
                tier = None
            if tier is not None and not isinstance(tier, str):
                raise HintError(f"service_tier: expected a string, got {tier!r}")
    custom = request.custom_params if isinstance(request.custom_params, Mapping) else None
    hinted = with_hinted_slo({"custom_params": custom}, hints, headers, tier,
                             getattr(request, "priority", None))
    if hinted is not None:
        request.custom_params = hinted["custom_params"]


def generate_step(hints: SloHints) -> Any:
    """The ``/generate`` route's step (``sglang_ext.adapter.front_door``): the hints, or a 400."""

    async def around_generate(original: Any, obj: Any, request: Any) -> Any:
        try:
            hint_generate(obj, hints, request.headers)
        except HintError as error:
            from fastapi.responses import ORJSONResponse

            return ORJSONResponse(status_code=400, content={"error": {"message": str(error)}})
        return await original(obj, request)

    return around_generate


def openai_step(hints: SloHints) -> Any:
    """The OpenAI routes' step (``sglang_ext.adapter.front_door``): the hints, or a 400."""

    async def around_openai(original: Any, serving: Any, request: Any, raw_request: Any = None,
                            *args: Any, **kwargs: Any) -> Any:
        try:
            await hint_openai(request, raw_request, hints)
        except HintError as error:
            return serving.create_error_response(str(error))
        return await original(serving, request, raw_request, *args, **kwargs)

    return around_openai

"""The extension's stamps in a request's ``sampling_params.custom_params``: read one,
set or remove one. Every stamp key starts with ``_fairbatching``; whoever stamps
overwrites what a client sent under that key."""

from __future__ import annotations

from typing import Any


def custom_param(request: Any, key: str) -> Any:
    """``key`` of ``request``'s ``custom_params`` (a ``Req`` or a tokenized request);
    None when absent or when ``custom_params`` is not a dict."""
    custom_params = getattr(getattr(request, "sampling_params", None), "custom_params", None)
    return custom_params.get(key) if isinstance(custom_params, dict) else None


def set_custom_param(sampling_params: Any, key: str, value: Any) -> None:
    """Set ``key`` (``value`` None: remove it); the dict is copied, never shared."""
    current = sampling_params.custom_params
    if value is None and not (isinstance(current, dict) and key in current):
        return
    custom_params = dict(current or {})
    if value is None:
        del custom_params[key]
    else:
        custom_params[key] = value
    sampling_params.custom_params = custom_params or None

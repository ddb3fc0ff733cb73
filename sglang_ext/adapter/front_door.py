"""One AROUND hook per HTTP route for every step the extension takes at SGLang's front
door, in order: the SLO hints (:mod:`sglang_ext.adapter.hinted_slo`), then the admission
gate's refusal (:mod:`sglang_ext.adapter.admission.budget_refusal`). SGLang's HookRegistry
runs several AROUND hooks on one target but warns at start-up that one skipping its
original bypasses the others, which each step does on purpose when it answers (a 400, a
429); chaining the steps in one hook states the order instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

GENERATE_ROUTE = "sglang.srt.entrypoints.http_server.serve_generate_request"
OPENAI_ROUTE = "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request"

#: an AROUND function: ``step(original, *args, **kwargs)``, which may answer without ``original``
Step = Callable[..., Any]


def chained(steps: Sequence[Step]) -> Step:
    """One AROUND function running ``steps`` in order, each the next one's caller."""

    def around(original: Any, *args: Any, **kwargs: Any) -> Any:
        call = original
        for step in reversed(steps):
            call = functools.partial(step, call)
        return call(*args, **kwargs)

    return around


def install_front_door(generate: Sequence[Step], openai: Sequence[Step]) -> None:
    """Register the route's chain where it has steps."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, steps in ((GENERATE_ROUTE, generate), (OPENAI_ROUTE, openai)):
        if steps:
            HookRegistry.register(target, chained(steps), HookType.AROUND)

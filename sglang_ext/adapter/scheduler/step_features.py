"""The step model's features of an SGLang batch: the roofline shape the emulated GPU
charges (``sglang_ext.adapter.batch_shape``), so the online model and the emulated device agree
on what a step computed — new tokens, the prompt part of them, and the KV already
present (``total_context``)."""

from __future__ import annotations

from typing import Any

from sglang_ext.adapter.batch_shape import batch_shape
from sglang_ext.policy.step_shape import StepShape


def step_features(batch: Any) -> StepShape:
    return batch_shape(batch).step

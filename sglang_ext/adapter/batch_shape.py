"""What an SGLang batch asks of the GPU, as the roofline model's :class:`StepShape`.

Works on any object with a ``ScheduleBatch``'s attributes (``forward_mode``, ``reqs``,
``extend_lens``, ``prefix_lens``, ``seq_lens_cpu``); it imports nothing from SGLang.

* DECODE: one new token per request; each reads the KV it already has (``seq_len - 1``:
  ``prepare_for_decode`` has already counted the token being computed).
* EXTEND / MIXED: row ``i`` computes ``extend_lens[i]`` tokens after ``prefix_lens[i]``
  cached ones.  In a MIXED batch the running decodes are appended as 1-token extends whose
  prefix covers their whole prompt; those rows are counted as decodes.  (A 1-token chunk of
  a re-prefill after retraction looks the same; the roofline costs both alike.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_ext.policy.step_shape import StepShape

__all__ = ["BatchShape", "batch_shape"]


@dataclass(frozen=True, slots=True)
class BatchShape:
    """A batch's step shape, its forward mode and SGLang's ``sum(seq_lens)``."""

    mode: str
    step: StepShape
    num_reqs: int
    seq_lens_sum: int


def batch_shape(batch: Any) -> BatchShape:
    """The shape of the forward step ``batch`` runs (see the module docstring)."""
    mode = batch.forward_mode
    reqs = batch.reqs
    seq_lens = _seq_lens(batch)
    if mode.is_decode():
        step = StepShape.from_requests(decode_context_lens=[n - 1 for n in seq_lens])
    elif mode.is_extend():
        chunks: list[tuple[int, int]] = []
        decodes: list[int] = []
        for req, new, prefix in zip(reqs, batch.extend_lens, batch.prefix_lens, strict=True):
            if new <= 0:
                continue
            if new == 1 and prefix >= len(req.origin_input_ids):
                decodes.append(prefix)
            else:
                chunks.append((new, prefix))
        step = StepShape.from_requests(prefill_chunks=chunks, decode_context_lens=decodes)
    else:
        step = StepShape(0, 0.0, 0, 0, 0, 0)
    return BatchShape(
        mode=mode.name.lower(), step=step, num_reqs=len(reqs), seq_lens_sum=sum(seq_lens)
    )


def _seq_lens(batch: Any) -> list[int]:
    lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
    if lens is None:
        return []
    return [int(n) for n in lens.tolist()] if hasattr(lens, "tolist") else [int(n) for n in lens]

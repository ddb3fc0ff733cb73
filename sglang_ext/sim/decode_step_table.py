"""The decode step-time lookup table of the disaggregated mode (Kairos's Algorithm 3 ``LUT``):
built offline from a GPU model's noise-free step times, read bilinearly."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sglang_ext.policy.step_shape import StepShape

TABLE_BATCH_SIZES = (*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                     1536, 2048, 4096)
TABLE_MIN_SEQ = 16



@dataclass(frozen=True, eq=False)
class DecodeStepTable:
    """``LUT[batch, seq_len]``: seconds of a decode step of ``batch`` requests each holding
    ``seq_len`` tokens of KV. Bilinear between grid points, clamped outside the grid."""

    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    step_s: np.ndarray  # shape (len(batch_sizes), len(seq_lens))

    def __post_init__(self) -> None:
        if self.step_s.shape != (len(self.batch_sizes), len(self.seq_lens)):
            raise ValueError(f"table of shape {self.step_s.shape} for a "
                             f"{len(self.batch_sizes)} x {len(self.seq_lens)} grid")
        for axis in (self.batch_sizes, self.seq_lens):
            if len(axis) < 2 or list(axis) != sorted(set(axis)) or axis[0] < 1:
                raise ValueError(f"grid axis {axis} must be >= 2 increasing positive values")
        if not np.all(np.isfinite(self.step_s)) or np.any(self.step_s <= 0):
            raise ValueError("step times must be finite and > 0")

    @classmethod
    def offline(cls, step_s: Callable[[StepShape], float], max_seq_len: int) -> DecodeStepTable:
        """Profile ``step_s`` (a GPU model's noise-free ``ideal_step_s``) over
        :data:`TABLE_BATCH_SIZES` x sequence lengths doubling from :data:`TABLE_MIN_SEQ`
        to the first at or past ``max_seq_len``."""
        seqs = [TABLE_MIN_SEQ]
        while seqs[-1] < max_seq_len:
            seqs.append(seqs[-1] * 2)
        seqs = seqs if len(seqs) > 1 else [TABLE_MIN_SEQ, 2 * TABLE_MIN_SEQ]
        grid = np.array([
            [step_s(StepShape(0, 0.0, 0, batch, batch * seq)) for seq in seqs]
            for batch in TABLE_BATCH_SIZES
        ])
        return cls(TABLE_BATCH_SIZES, tuple(seqs), grid)

    def lookup(self, batch: int, seq_len: int) -> float:
        (i, wi), (j, wj) = _weight(self.batch_sizes, batch), _weight(self.seq_lens, seq_len)
        s = self.step_s
        low = s[i, j] * (1 - wj) + s[i, j + 1] * wj
        high = s[i + 1, j] * (1 - wj) + s[i + 1, j + 1] * wj
        return float(low * (1 - wi) + high * wi)

    def cell(self, batch: int, seq_len: int) -> tuple[int, int]:
        """The grid point nearest ``(batch, seq_len)``."""
        (i, wi), (j, wj) = _weight(self.batch_sizes, batch), _weight(self.seq_lens, seq_len)
        return i + (wi > 0.5), j + (wj > 0.5)


def _weight(axis: tuple[int, ...], value: float) -> tuple[int, float]:
    """Index ``i`` and weight ``w`` of ``value`` between ``axis[i]`` and ``axis[i + 1]``."""
    i = min(max(bisect.bisect_right(axis, value) - 1, 0), len(axis) - 2)
    w = (value - axis[i]) / (axis[i + 1] - axis[i])
    return i, min(max(w, 0.0), 1.0)

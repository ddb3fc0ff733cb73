"""What one forward step computes: the features every step-time model reads (the
predictors in :mod:`sglang_ext.policy.step_model`, the simulator's GPU)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["StepShape"]


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one forward step computes (the features a step-time model sees).

    For prefill chunks ``i`` of ``n_i`` new tokens after ``prefix_i`` already-cached tokens:
    ``prefill_tokens = sum n_i``, ``prefill_attention_pairs = sum n_i * (prefix_i + (n_i + 1) / 2)``
    (causal query-key pairs) and ``prefill_context = sum prefix_i``.  Each decode adds one new
    token and reads its whole KV (``decode_context`` = sum of the decoding requests' KV lengths).
    Use :meth:`from_requests` to build one from per-request numbers.
    """

    prefill_tokens: int
    prefill_attention_pairs: float
    prefill_context: int
    decode_requests: int
    decode_context: int
    prefill_requests: int = 0

    @property
    def new_tokens(self) -> int:
        """Tokens computed this step: prefill tokens plus one per decode."""
        return self.prefill_tokens + self.decode_requests

    @property
    def num_requests(self) -> int:
        """Requests in the batch (prefill chunks plus decodes)."""
        return self.prefill_requests + self.decode_requests

    @property
    def total_context(self) -> int:
        """Cached tokens read by attention (the linear predictor's context feature)."""
        return self.prefill_context + self.decode_context

    @classmethod
    def from_requests(
        cls,
        prefill_chunks: Iterable[tuple[int, int]] = (),
        decode_context_lens: Iterable[int] = (),
    ) -> StepShape:
        """Build a shape from ``(chunk_len, prefix_len)`` pairs and decode KV lengths."""
        p_tokens = 0
        p_pairs = 0.0
        p_ctx = 0
        p_reqs = 0
        for n, prefix in prefill_chunks:
            if n <= 0 or prefix < 0:
                raise ValueError(f"bad prefill chunk (len={n}, prefix={prefix})")
            p_tokens += n
            p_pairs += n * (prefix + (n + 1) / 2.0)
            p_ctx += prefix
            p_reqs += 1
        d_reqs = 0
        d_ctx = 0
        for c in decode_context_lens:
            if c < 0:
                raise ValueError(f"bad decode context length {c}")
            d_reqs += 1
            d_ctx += c
        return cls(p_tokens, p_pairs, p_ctx, d_reqs, d_ctx, p_reqs)


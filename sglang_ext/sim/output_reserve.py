"""The KV SGLang sets aside for outputs still to come, as its prefill admission reserves it.

SGLang 0.5.23's ``PrefillAdder`` starts a new prompt only when the prompt plus all of its
outputs (``min(max_new_tokens, CLIP_MAX_NEW_TOKENS)``) fit in the free KV left after each
running request's remaining outputs, scaled by ``new_token_ratio``: the share of a
request's ``max_new_tokens`` it expects still to decode. The ratio starts at 0.7, falls by
a 600th of the way to 0.14 of that per decode-only step (a step that admits or continues
a prompt leaves it), is re-estimated from the batch when a decode finds the pool full
(``NewTokenRatioTracker``), and starts over whenever the scheduler idles. The simulator's
outputs stand for ``max_new_tokens``, as a benchmark client sets it to the output it wants.
"""

from __future__ import annotations

from collections.abc import Iterable

CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_DECODE_STEPS = 20


def reserved_outputs(remaining_outputs: int, ratio: float = 1.0) -> float:
    """KV tokens set aside for ``remaining_outputs`` tokens still to decode."""
    return min(max(remaining_outputs, 0), CLIP_MAX_NEW_TOKENS) * ratio


class NewTokenRatio:
    """SGLang's ``new_token_ratio`` for one scheduler."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current = INIT_NEW_TOKEN_RATIO

    def decay_step(self) -> None:
        self.current = max(self.current - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def reset(self) -> None:
        self.current = INIT_NEW_TOKEN_RATIO

    def after_retraction(self, kept: Iterable[tuple[int, int]]) -> None:
        """Re-estimate from the decodes kept, as ``(outputs so far, max_new_tokens)``."""
        decoded = total = count = 0
        for outputs, max_new in kept:
            decoded += outputs
            total += max_new
            count += 1
        self.current = min(1.0, (decoded + RETRACT_DECODE_STEPS * count) / (total + 1))

"""Refusing requests for outputs the emulated GPU cannot produce.

The emulated GPU returns token ids only: no logits, logprobs, hidden states or embeddings,
and it runs no encoder.  A request asking for any of those is refused in the HTTP server's
TokenizerManager (its per-request validation raises ``ValueError``, which SGLang answers
with HTTP 400), before it could reach -- and crash -- the scheduler.
"""

from __future__ import annotations

from typing import Any

from .settings import ENV_PROFILE

__all__ = ["reject_unsupported_request", "unsupported_features"]

#: (attribute, what it asks for) -- truthy attribute values are refused.
_OUTPUT_FLAGS = (
    ("return_logprob", "return_logprob (logprobs)"),
    ("token_ids_logprob", "token_ids_logprob"),
    ("return_hidden_states", "return_hidden_states"),
    ("return_routed_experts", "return_routed_experts"),
    ("return_indexer_topk", "return_indexer_topk"),
    ("return_sampling_mask", "return_sampling_mask"),
    ("return_entropy", "return_entropy"),
)
#: (attribute, what it is) -- inputs refused when present (not None and not empty).
_INPUTS = (
    ("input_embeds", "input_embeds"),
    ("image_data", "image_data (multimodal input)"),
    ("video_data", "video_data (multimodal input)"),
    ("audio_data", "audio_data (multimodal input)"),
    ("positional_embed_overrides", "positional_embed_overrides"),
)


def unsupported_features(obj: Any) -> list[str]:
    """What a ``GenerateReqInput`` / ``EmbeddingReqInput`` asks for that the emulator lacks."""
    found: list[str] = []
    if type(obj).__name__ == "EmbeddingReqInput":
        found.append("embeddings")
    for attr, label in _OUTPUT_FLAGS:
        value = getattr(obj, attr, None)
        if _requested(value):
            found.append(label)
    for attr, label in _INPUTS:
        value = getattr(obj, attr, None)
        if value is not None and not (isinstance(value, (list, tuple, dict)) and not value):
            found.append(label)
    return found


def reject_unsupported_request(obj: Any) -> None:
    """Raise ``ValueError`` naming what ``obj`` asks for that the emulated GPU cannot give."""
    found = unsupported_features(obj)
    if found:
        raise ValueError(
            f"not supported by the emulated GPU ({ENV_PROFILE} is set; it computes token ids "
            f"only): {', '.join(found)}. Send the request without it, or run on a real GPU."
        )


def _requested(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_requested(v) for v in value)
    return bool(value)

"""Which token the emulated GPU "samples": fixed, in the vocabulary, never a stop token.

Every request therefore runs to its ``max_new_tokens`` (unless a stop *string* matches the
emitted text).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

__all__ = ["TokenPicker"]


class TokenPicker:
    """Picks the first candidate id in ``[0, vocab_size)`` that is not a stop id.

    ``preferred`` ids are tried first (e.g. a tokenizer's id for a common word), then the
    ids from ``vocab_size // 2`` upward and wrapping around.  :meth:`for_request` re-picks
    only for a request whose own stop ids contain the default.
    """

    __slots__ = ("_excluded", "_order", "default", "vocab_size")

    def __init__(
        self, vocab_size: int, stop_ids: Iterable[int], preferred: Sequence[int] = ()
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self._excluded = frozenset(int(t) for t in stop_ids)
        half = vocab_size // 2
        self._order = [*preferred, *range(half, vocab_size), *range(half)]
        self.default = self._first_allowed(())

    def _first_allowed(self, extra_stop_ids: Collection[int]) -> int:
        for token in self._order:
            allowed = token not in self._excluded and token not in extra_stop_ids
            if allowed and 0 <= token < self.vocab_size:
                return token
        raise ValueError("every token id in the vocabulary is a stop token")

    def for_request(self, *stop_id_sets: Collection[int] | None) -> int:
        """The token for a request with these extra stop-id sets (any may be None)."""
        token = self.default
        if not any(s and token in s for s in stop_id_sets):
            return token
        merged = set().union(*(s for s in stop_id_sets if s))
        return self._first_allowed(merged)

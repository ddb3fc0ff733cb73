"""Shared prompt prefixes for the cluster simulator: which requests share which prefix, the
prompt each request stands for, and each rank's prefix cache.

The simulator has token counts, not text. A request with a :class:`SharedPrefix` stands for
a prompt whose first ``tokens`` tokens are its group's (the same for every request of the
group) and whose rest is its own; a request without one for a prompt all its own. A prompt
is a tuple of units of :data:`UNIT_TOKENS` tokens each (a partial last unit is dropped),
named so that equal units mean equal tokens: that tuple is what the router's prefix tree
(:mod:`controlplane.prefix_affinity`, one unit a block) and the rank's cache match on.

:class:`RankPrefixCache` models SGLang's radix cache on one rank, simply:

- a prompt's units enter the cache when its prefill completes (its first token); a request
  dispatched meanwhile does not share them;
- a dispatched request's cached tokens (its longest cached prefix, never the whole prompt)
  are not prefilled: the rank's engine gets only the rest, as its prompt, so neither the
  cached tokens' compute nor their attention cost is simulated, and its KV is not charged
  for them (a prefix shared by running requests is held once);
- the cache holds at most the KV the engine's requests leave free (capacity minus what
  they hold) or ``max_tokens`` if lower, evicting least recently used leaves first, when
  a prompt is matched or inserted.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.prefix_affinity import PrefixAffinity

UNIT_TOKENS = 16  # tokens per unit of a simulated prompt (a KV page of 16 tokens)
_RANK = "self"


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    group: int
    tokens: int  # the shared tokens at the start of the prompt


def prompt_units(index: int, prompt_tokens: int, prefix: SharedPrefix | None) -> tuple[int, ...]:
    """The units of request ``index``'s prompt: its group's prefix units (non-negative
    names), then units of its own (negative names, unique to the request)."""
    shared = 0 if prefix is None else min(prefix.tokens, prompt_tokens) // UNIT_TOKENS
    own = prompt_tokens // UNIT_TOKENS - shared
    base = prefix.group << 20 if prefix is not None else 0
    return (tuple(base + j for j in range(shared))
            + tuple(-(index << 20) - j - 1 for j in range(own)))


class RankPrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._tree = PrefixAffinity(block_size=1, max_blocks_per_rank=max(1, max_tokens // UNIT_TOKENS))

    def cached_tokens(self, units: tuple[int, ...], prompt_tokens: int, free_tokens: int) -> int:
        """The prompt's tokens this rank holds (never all of them), after evicting down to
        ``free_tokens`` of KV."""
        self._fit(free_tokens)
        held = self._tree.match(units).matched_units.get(_RANK, 0) * UNIT_TOKENS
        return min(held, prompt_tokens - 1)

    def insert(self, units: tuple[int, ...], free_tokens: int) -> None:
        self._tree.record(_RANK, units)
        self._fit(free_tokens)

    @property
    def held_tokens(self) -> int:
        return self._tree.held_blocks(_RANK) * UNIT_TOKENS

    def _fit(self, free_tokens: int) -> None:
        self._tree.shrink(_RANK, min(self.max_tokens, max(0, free_tokens)) // UNIT_TOKENS)

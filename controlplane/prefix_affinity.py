"""Which rank probably holds a prompt's prefix in its KV cache: an approximate radix tree
per rank, built from the prompts routed to it (smg's ``cache_aware`` idea), pure and
stdlib only.

A prompt is a sequence of units (the characters of its text, or its token ids) cut into
blocks of ``block_size`` units; a trailing partial block is ignored. Block ``i`` is named by
a chained hash of blocks ``0..i``, so one name stands for a whole path from the root: the
tree is stored flat, one shared index from block name to the ranks holding it, and a rank
matches the leading blocks it holds without a gap. Matching is exact to the block (hash
collisions aside); the tree is approximate in what it believes: a rank is assumed to keep
what was routed to it until this index evicts it, whatever the rank itself evicted.

Memory bound: each rank holds at most ``max_blocks_per_rank`` blocks. :meth:`record`
touches a prompt's blocks from the last to the first, so a block is never less recent than
any block below it and the least recently used block of a rank is always one of its leaves:
eviction removes the least recently used leaves first, as a radix cache does.

Hence what a rank holds is closed under ancestors: if it holds block ``i`` of a prompt's
chain it holds blocks ``0..i``. :meth:`match` relies on that and finds each rank's depth by
bisection, a few lookups per rank instead of one step per block of the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Prompt = str | Sequence[int]

DEFAULT_BLOCK_SIZE = 64  # characters of text (about 16 tokens), or token ids
DEFAULT_MAX_BLOCKS_PER_RANK = 1 << 16  # 4 Mi characters of text per rank at 64 a block
_NONE: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's chained block names and its length in units (blocks cover ``len(names) x
    block_size`` of them)."""

    names: tuple[int, ...]
    units: int


@dataclass(frozen=True, slots=True)
class AffinityMatch:
    """Per rank, the prompt's leading units it holds (ranks holding none are absent)."""

    matched_units: Mapping[str, int]
    prompt_units: int

    def ratio(self, rank: str) -> float:
        """The share of the prompt ``rank`` holds (0 for an empty prompt)."""
        return self.matched_units.get(rank, 0) / self.prompt_units if self.prompt_units else 0.0

    def cached_tokens(self, rank: str, prompt_tokens: int) -> int:
        """The prompt's tokens ``rank`` holds, scaled from units to tokens, never all of
        them (a rank computes at least the last token)."""
        if prompt_tokens <= 0:
            return 0
        return min(prompt_tokens - 1, int(self.ratio(rank) * prompt_tokens))


class PrefixAffinity:
    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_blocks_per_rank: int = DEFAULT_MAX_BLOCKS_PER_RANK) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        if max_blocks_per_rank < 1:
            raise ValueError(f"max blocks per rank must be >= 1, got {max_blocks_per_rank}")
        self.block_size = block_size
        self.max_blocks_per_rank = max_blocks_per_rank
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def blocks(self, prompt: Prompt) -> PromptBlocks:
        size = self.block_size
        starts = range(0, len(prompt) - size + 1, size)
        if isinstance(prompt, str):
            chunks: list[str | tuple[int, ...]] = [prompt[start:start + size] for start in starts]
        else:
            chunks = [tuple(prompt[start:start + size]) for start in starts]
        names: list[int] = []
        name = 0
        for chunk in chunks:
            name = hash((name, chunk))
            names.append(name)
        return PromptBlocks(tuple(names), len(prompt))

    def match(self, prompt: Prompt | PromptBlocks) -> AffinityMatch:
        """Every rank's longest held prefix of ``prompt``, in units."""
        blocks = prompt if isinstance(prompt, PromptBlocks) else self.blocks(prompt)
        names, holders = blocks.names, self._holders
        first = holders.get(names[0], _NONE) if names else _NONE
        matched: dict[str, int] = {}
        for rank in first:
            held, missing = 1, len(names)  # holds names[:held]; names[missing:] unknown or not held
            while held < missing:
                middle = (held + missing) // 2
                if rank in holders.get(names[middle], _NONE):
                    held = middle + 1
                else:
                    missing = middle
            matched[rank] = held * self.block_size
        return AffinityMatch(matched, blocks.units)

    def record(self, rank: str, prompt: Prompt | PromptBlocks) -> None:
        """``rank`` now holds ``prompt`` (it was routed there); evicts that rank's least
        recently used leaves beyond the bound."""
        blocks = prompt if isinstance(prompt, PromptBlocks) else self.blocks(prompt)
        lru = self._lru.setdefault(rank, OrderedDict())
        holders = self._holders
        for name in reversed(blocks.names):
            if name in lru:
                lru.move_to_end(name)
            else:
                lru[name] = None
                holders.setdefault(name, set()).add(rank)
        self.shrink(rank, self.max_blocks_per_rank)

    def shrink(self, rank: str, max_blocks: int) -> None:
        """Evict ``rank``'s least recently used leaves until it holds at most ``max_blocks``."""
        lru = self._lru.get(rank)
        if lru is None:
            return
        holders = self._holders
        while len(lru) > max(0, max_blocks):
            name, _ = lru.popitem(last=False)
            held = holders[name]
            held.discard(rank)
            if not held:
                del holders[name]

    def forget(self, rank: str) -> None:
        """Drop everything ``rank`` holds (it left, or restarted with an empty cache)."""
        self.shrink(rank, 0)
        self._lru.pop(rank, None)

    def held_blocks(self, rank: str) -> int:
        lru = self._lru.get(rank)
        return 0 if lru is None else len(lru)

    @property
    def indexed_blocks(self) -> int:
        """Distinct block names held by any rank (the shared index's size)."""
        return len(self._holders)

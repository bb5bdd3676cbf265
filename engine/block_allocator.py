"""Which cache block belongs to whom: tables that grow on demand, release exactly once.

Pure Python (no torch): the scheduler decides with it, the model runner only reads
the block ids it hands out. A sequence gets a ``BlockTable`` at admission
(``reserve``) covering the positions it will write first, and the table grows
(``grow``) a block at a time as the sequence writes past its end; with the
reservation scheme the first allocation already covers everything the sequence can
ever need. A table's blocks go back to the pool in exactly one place,
``BlockAllocator.release``, which raises ``DoubleRelease`` if the same table is
released twice. A released table is never used again: a preempted sequence that is
admitted again gets a new one.

Prefix caching (``prefix_cache=True``; off, all of what follows is inert and the pool
behaves exactly as a plain free list). A block is *shared*: it has a reference count,
one reference per table that holds it, and a table holds a block at most once. A
full block whose positions are all written may be *committed* (``commit``) under its
identity, a digest of its tokens chained to its parent's (``prefix_cache.
block_digests``): the positions of a block are the same keys and values in every
sequence whose tokens up to its end are the same. ``reserve`` given a sequence's
digests takes a reference to each block of the longest committed prefix (a *hit*)
and allocates only the rest. ``release`` drops the table's references, each exactly
once; a block left with none goes back to the free list if it was never committed,
else it stays committed and becomes *evictable*: an LRU list, the block released
longest ago first (a table's blocks enter it last block first, so a chain's tail is
evicted before its head). Allocation takes a free block first, then evicts the least
recently used evictable one (its identity is forgotten). ``num_free`` counts both:
every unreferenced block can be had. A committed block is never written again: a
sequence writes only positions past the ones it found cached, and commits only what
it has written, so a block's contents never change while it is committed.

Every block is in exactly one of three states: free, evictable (committed, no
reference), referenced (by one or more live tables); ``check`` asserts it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import DoubleRelease


@dataclass(slots=True)
class BlockTable:
    """The blocks held by one sequence, in position order (one reference each)."""

    owner: str
    block_ids: list[int]
    is_released: bool = field(default=False)
    num_hit_tokens: int = 0  # leading positions found cached at reserve (prefix cache)
    num_committed: int = 0  # leading full blocks already offered to ``commit``


class BlockAllocator:
    """A pool of fixed-size blocks; tables allocated, grown, released once.

    Args:
        num_blocks, block_size: the pool.
        prefix_cache: share committed full blocks between tables (module docstring).
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_cache: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # committed: identity -> block
        self._digest_of: dict[int, bytes] = {}  # committed: block -> identity
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.num_releases = 0
        self.num_evictions = 0  # committed blocks whose identity was dropped for space
        self.num_query_tokens = 0  # positions looked up at reserve (vLLM's queries)
        self.num_hit_tokens = 0  # of those, found cached (vLLM's hits)
        self.num_shared = 0  # blocks referenced by more than one table

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and evictable (cached, unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_reserved(self) -> int:
        """Blocks held by tables (referenced)."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Committed blocks, referenced or evictable."""
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match(self, digests: Sequence[bytes]) -> list[int]:
        """The committed blocks of the longest prefix of ``digests`` (no reference taken)."""
        hits: list[int] = []
        for digest in digests:
            block = self._block_of.get(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_reserve(
        self, num_tokens: int, headroom: int = 0, digests: Sequence[bytes] = ()
    ) -> bool:
        """Whether ``num_tokens`` positions fit, leaving ``headroom`` blocks free; with
        ``digests``, the cached prefix they match is shared, not allocated (but a hit
        on an evictable block takes it from the free count)."""
        hits = self.match(digests)
        taken = self.blocks_needed(num_tokens) - len(hits)
        taken += sum(self._refs[b] == 0 for b in hits)
        return taken + headroom <= self.num_free

    def reserve(
        self, owner: str, num_tokens: int, digests: Sequence[bytes] = (), query_tokens: int = 0
    ) -> BlockTable:
        """A new table covering ``num_tokens`` positions, sharing the cached prefix of
        ``digests`` (at most the blocks of ``num_tokens``); the caller checked
        can_reserve. ``query_tokens``: the positions looked up, for the statistics."""
        hits = self.match(digests)[: self.blocks_needed(num_tokens)]
        for block in hits:
            self._take_reference(block)
        hit_tokens = min(len(hits) * self.block_size, num_tokens)
        table = BlockTable(owner, hits, num_hit_tokens=hit_tokens, num_committed=len(hits))
        if self.prefix_cache:
            self.num_query_tokens += query_tokens
            self.num_hit_tokens += hit_tokens
        self.grow(table, num_tokens)
        return table

    def blocks_to_grow(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks ``table`` lacks to cover ``num_tokens`` positions."""
        return max(self.blocks_needed(num_tokens) - len(table.block_ids), 0)

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Append blocks until ``table`` covers ``num_tokens`` positions.

        Raises:
            RuntimeError: not enough free blocks (nothing was taken); the caller checks
                ``blocks_to_grow`` against ``num_free`` first.
        """
        if table.is_released:
            raise RuntimeError(f"{table.owner}: a released table is never used again")
        count = self.blocks_to_grow(table, num_tokens)
        if count > self.num_free:
            raise RuntimeError(f"{table.owner}: {count} blocks needed, {self.num_free} free")
        table.block_ids.extend(self._allocate() for _ in range(count))

    def commit(self, table: BlockTable, digests: Sequence[bytes], num_written: int) -> None:
        """Offer the table's full blocks within its first ``num_written`` positions, whose
        identities are ``digests``, to the cache. A block whose identity another block
        already has (both computed at once) stays the table's own."""
        if not self.prefix_cache or table.is_released:
            return
        full = min(num_written // self.block_size, len(digests), len(table.block_ids))
        for index in range(table.num_committed, full):
            digest, block = digests[index], table.block_ids[index]
            if digest not in self._block_of and block not in self._digest_of:
                self._block_of[digest] = block
                self._digest_of[block] = digest
        table.num_committed = max(table.num_committed, full)

    def release(self, table: BlockTable) -> None:
        """Drop a table's references. The one place blocks are given back."""
        if table.is_released:
            raise DoubleRelease(f"blocks of {table.owner!r} released twice")
        table.is_released = True
        for block in reversed(table.block_ids):
            self._refs[block] -= 1
            self.num_shared -= self._refs[block] == 1
            assert self._refs[block] >= 0, f"block {block} released more than it was held"
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._evictable[block] = None  # the most recently used end
                else:
                    self._free.append(block)
        self.num_releases += 1
        # Invariant: no block is both free and in a live table.
        assert len(self._free) + len(self._evictable) <= self.num_blocks

    def check(self) -> None:
        """Assert the invariants: each block free, evictable or referenced, only one."""
        free, evictable = set(self._free), set(self._evictable)
        referenced = {b for b, n in enumerate(self._refs) if n > 0}
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not (free & evictable) and not (free & referenced) and not (evictable & referenced)
        assert free | evictable | referenced == set(range(self.num_blocks))
        assert min(self._refs) >= 0
        assert evictable <= set(self._digest_of) and not (free & set(self._digest_of))
        assert {b: d for d, b in self._block_of.items()} == self._digest_of

    def references(self, block: int) -> int:
        """How many live tables hold ``block``."""
        return self._refs[block]

    def is_committed(self, block: int) -> bool:
        """Whether ``block`` is cached under an identity (so never written again)."""
        return block in self._digest_of

    def _take_reference(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1
        self.num_shared += self._refs[block] == 2

    def _allocate(self) -> int:
        """A block for one new reference: a free one, else the least recently used
        evictable one (its identity dropped)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._digest_of.pop(block)]
            self.num_evictions += 1
        self._refs[block] = 1
        return block

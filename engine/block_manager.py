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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import DoubleRelease


@dataclass(slots=True)
class BlockTable:
    """The blocks held by one sequence, in position order."""

    owner: str
    block_ids: list[int]
    is_released: bool = field(default=False)


class BlockAllocator:
    """A free list of fixed-size blocks; tables allocated, grown, released once."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.num_releases = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        """Blocks held by tables (not free)."""
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_reserve(self, num_tokens: int, headroom: int = 0) -> bool:
        """Whether ``num_tokens`` positions fit, leaving ``headroom`` blocks free."""
        return self.blocks_needed(num_tokens) + headroom <= len(self._free)

    def reserve(self, owner: str, num_tokens: int) -> BlockTable:
        """A new table covering ``num_tokens`` positions; the caller checked can_reserve."""
        table = BlockTable(owner, [])
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
        if count > len(self._free):
            raise RuntimeError(f"{table.owner}: {count} blocks needed, {len(self._free)} free")
        table.block_ids.extend(self._free.pop() for _ in range(count))

    def release(self, table: BlockTable) -> None:
        """Return a table's blocks to the pool. The one place blocks are freed."""
        if table.is_released:
            raise DoubleRelease(f"blocks of {table.owner!r} released twice")
        table.is_released = True
        self._free.extend(reversed(table.block_ids))
        self.num_releases += 1
        # Invariant: no block is both free and in a live table.
        assert len(self._free) <= self.num_blocks

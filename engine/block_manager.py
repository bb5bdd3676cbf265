"""Which cache block belongs to whom: reservation at admission, release exactly once.

Pure Python (no torch): the scheduler decides with it, the model runner only reads
the block ids it hands out. A sequence gets a ``BlockTable`` at admission holding
every block it can ever need (prompt plus max new tokens), so a running sequence
never runs out. Its blocks go back to the pool in exactly one place,
``BlockAllocator.release``, which raises ``DoubleRelease`` if the same table is
released twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import DoubleRelease


@dataclass(slots=True)
class BlockTable:
    """The blocks reserved for one sequence, in position order."""

    owner: str
    block_ids: list[int]
    is_released: bool = field(default=False)


class BlockAllocator:
    """A free list of fixed-size blocks; reservation at admission, release once."""

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
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_reserve(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    def reserve(self, owner: str, num_tokens: int) -> BlockTable:
        """Take every block ``num_tokens`` positions need; the caller checked can_reserve."""
        count = self.blocks_needed(num_tokens)
        if count > len(self._free):
            raise RuntimeError(f"{owner}: {count} blocks needed, {len(self._free)} free")
        return BlockTable(owner, [self._free.pop() for _ in range(count)])

    def release(self, table: BlockTable) -> None:
        """Return a table's blocks to the pool. The one place blocks are freed."""
        if table.is_released:
            raise DoubleRelease(f"blocks of {table.owner!r} released twice")
        table.is_released = True
        self._free.extend(reversed(table.block_ids))
        self.num_releases += 1
        # Invariant: no block is both free and in a live table.
        assert len(self._free) <= self.num_blocks

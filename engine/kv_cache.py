"""The paged KV cache's tensors (torch); which block is whose is ``block_manager``'s.

``PagedKVCache`` owns the tensors: per layer, one key and one value tensor of
``num_blocks * block_size`` slots, allocated once. Position ``p`` of a sequence
lives in slot ``table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """Key and value tensors for every layer, ``(slots, kv_heads, head_dim)`` each."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slot index of each position; ``tables`` is (batch, blocks), positions (batch, n)."""
        block_index = torch.div(positions, self.block_size, rounding_mode="floor")
        return tables.gather(1, block_index) * self.block_size + positions % self.block_size

"""The paged KV cache's tensors (torch); which block is whose is ``block_allocator``'s.

``PagedKVCache`` owns the tensors: per layer, one key and one value tensor of
``num_blocks * block_size`` slots, allocated once. Position ``p`` of a sequence
lives in slot ``table[p // block_size] * block_size + p % block_size``.

The tensors are allocated, not written (``torch.empty``): writing zeros into a cache of a
tenth of the machine's memory took most of a start (issue 27), and committed all of it
before any request; unwritten, the pages are committed as sequences first write them, so
memory follows what the sequences use. A slot therefore holds garbage (NaN, from a reused
allocation) until its position is written, and nothing may read a slot before that, not
even to mask it out (0 x NaN is NaN): a decode row's padding reads its own newest
position (``attention._read_group``), a chunk its written prefix. ``fill_for_test``
floods slots with NaN so that a test sees any read that breaks this
(tests/test_cache_unwritten.py).

``blocks_for_memory`` sizes the cache from a memory budget: the bytes of one
position (layers x 2 (key, value) x kv heads x head dim x dtype size, from the
model's config) and the device's available memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .startup import phase

if TYPE_CHECKING:
    from .model import LoadedModel


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    num_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Cache bytes one position takes: its key and value in every layer."""
    layers, kv_heads, head_dim = kv_geometry(config)
    return layers * 2 * kv_heads * head_dim * dtype.itemsize


def available_memory(device: torch.device) -> int:
    """Bytes free for the cache: the GPU's free memory, or the machine's available
    memory (``MemAvailable``; else the free pages ``os.sysconf`` counts)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def blocks_for_memory(
    loaded: LoadedModel, block_size: int, memory: float | int, *, max_positions: int
) -> int:
    """Blocks of ``block_size`` positions that ``memory`` holds for ``loaded``'s model: a
    float is a share of the available memory, an int bytes. At most the blocks of
    ``max_positions`` (more could never be used at once), at least one."""
    per_token = kv_bytes_per_token(loaded.model.config, loaded.model.dtype)
    if isinstance(memory, float):
        if not 0 < memory <= 1:
            raise ValueError(f"a share of memory must be in (0, 1], got {memory}")
        budget = int(memory * available_memory(loaded.device))
    else:
        budget = memory
    blocks = budget // (per_token * block_size)
    return max(1, min(blocks, -(-max_positions // block_size)))


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
        with phase("cache"):  # allocated, not written: see the module docstring
            self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.empty(shape, dtype=dtype, device=device)
                           for _ in range(num_layers)]

    def fill_for_test(self, value: float, blocks: list[int] | None = None) -> None:
        """Write ``value`` into every slot of ``blocks`` (None: the whole cache). For
        tests only: a NaN in a slot nobody wrote shows a read before a write."""
        for tensor in (*self.keys, *self.values):
            if blocks is None:
                tensor.fill_(value)
            else:
                view = tensor.view(-1, self.block_size, *tensor.shape[1:])
                view[torch.tensor(blocks, dtype=torch.long, device=tensor.device)] = value

    def slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slot index of each position; ``tables`` is (batch, blocks), positions (batch, n)."""
        block_index = torch.div(positions, self.block_size, rounding_mode="floor")
        return tables.gather(1, block_index) * self.block_size + positions % self.block_size

"""The paged KV cache: block bookkeeping, release exactly once, and slot addressing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import DoubleRelease, GenerationRequest, SamplingParams
from engine.block_allocator import BlockAllocator, BlockTable
from engine.engine import Engine
from engine.kv_cache import PagedKVCache

MakeEngine = Callable[..., Engine]


@pytest.mark.parametrize(("num_tokens", "blocks"), [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_rounds_up_to_whole_blocks(num_tokens: int, blocks: int) -> None:
    assert BlockAllocator(16, 4).blocks_needed(num_tokens) == blocks


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_allocator_rejects_non_positive_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockAllocator(num_blocks, block_size)


def test_reserve_takes_every_block_the_tokens_need() -> None:
    allocator = BlockAllocator(8, 4)
    table = allocator.reserve("a", 9)
    assert (table.owner, table.block_ids, table.is_released) == ("a", [0, 1, 2], False)
    assert (allocator.num_free, allocator.num_reserved) == (5, 3)


def test_reserve_beyond_the_free_blocks_raises_and_takes_nothing() -> None:
    allocator = BlockAllocator(4, 4)
    allocator.reserve("a", 8)
    assert not allocator.can_reserve(9)
    with pytest.raises(RuntimeError, match="3 blocks needed, 2 free"):
        allocator.reserve("b", 9)
    assert allocator.num_free == 2


def test_release_returns_every_block_to_the_pool() -> None:
    allocator = BlockAllocator(8, 4)
    table = allocator.reserve("a", 16)
    allocator.release(table)
    assert (allocator.num_free, allocator.num_releases, table.is_released) == (8, 1, True)
    assert allocator.reserve("b", 32).block_ids == list(range(8))


def test_release_twice_raises_double_release() -> None:
    allocator = BlockAllocator(8, 4)
    table = allocator.reserve("a", 8)
    allocator.release(table)
    with pytest.raises(DoubleRelease, match="'a'"):
        allocator.release(table)
    assert (allocator.num_free, allocator.num_releases) == (8, 1)  # the pool is unchanged


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_live_tables_never_share_a_block(ops: list[tuple[bool, int]]) -> None:
    # Each op reserves num_tokens if it fits, or releases the oldest live table.
    allocator = BlockAllocator(16, 4)
    live: list[BlockTable] = []
    for is_reserve, num_tokens in ops:
        if is_reserve and allocator.can_reserve(num_tokens):
            live.append(allocator.reserve(f"r{len(live)}", num_tokens))
        elif live:
            allocator.release(live.pop(0))
        held = [block for table in live for block in table.block_ids]
        assert len(held) == len(set(held))  # no block in two live tables
        assert allocator.num_free + len(held) == 16  # and none lost


def test_slots_follow_each_block_table() -> None:
    cache = PagedKVCache(
        num_layers=1,
        num_blocks=16,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    tables = torch.tensor([[7, 3, 12], [0, 15, 9]])
    positions = torch.tensor([[0, 3, 4, 11], [2, 5, 8, 9]])
    expected = [
        [t[p // 4] * 4 + p % 4 for p in row]
        for t, row in zip(tables.tolist(), positions.tolist(), strict=True)
    ]
    assert (
        cache.slots(tables, positions).tolist() == expected == [[28, 31, 12, 51], [2, 61, 36, 37]]
    )


def test_cache_tensors_are_allocated_once_per_layer() -> None:
    cache = PagedKVCache(
        num_layers=3,
        num_blocks=5,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for tensors in (cache.keys, cache.values):
        assert [tuple(t.shape) for t in tensors] == [(20, 2, 8)] * 3
        assert len({t.data_ptr() for t in tensors}) == 3
    # Allocated, not written (torch.empty): tests/test_cache_unwritten.py checks that
    # nothing reads a slot before its position is written, and what that saves.


# -- the engine's use of the cache ----------------------------------------------------------


def test_engine_holds_blocks_as_it_writes_until_the_finish(
    make_tiny_engine: MakeEngine,
) -> None:
    """The lab's reservation holds all 4 from admission (tests/test_lab_reservation.py)."""
    engine = make_tiny_engine(num_blocks=16, block_size=4)
    # 8 prompt tokens + 5 new = 13 positions: the prompt's 2 blocks, a third when
    # position 8 is written.
    engine.submit(
        GenerationRequest(
            "a", "The capital of France is", 5, sampling=SamplingParams(ignore_eos=True)
        )
    )
    reserved = []
    while engine.has_work():
        engine.step()
        reserved.append(engine.statistics().blocks_reserved)
    assert reserved == [2, 3, 3, 3, 0]
    assert engine.statistics().releases == 1


def test_engine_releases_a_finished_sequence_exactly_once(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(GenerationRequest("a", "Every stream", 3))
    engine.step()
    seq = engine.scheduler.running["a"]
    while engine.has_work():
        engine.step()
    assert seq.block_table is not None
    assert seq.block_table.is_released
    with pytest.raises(DoubleRelease):
        engine.allocator.release(seq.block_table)

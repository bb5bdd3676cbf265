"""A cache position is never read before it is written (issue 27).

The KV cache is allocated with ``torch.empty`` (``engine/kv_cache.py``): a slot holds
whatever the memory held until its position is written, NaN included. A read of such a
slot is a bug even when attention masks it out, since 0 x NaN is NaN. Here the cache is
flooded with NaN, at the start and in every block as it is freed, and the same steps run
again over a cache of zeros: the tokens must be the same, and no logit may be NaN, on the
tiny GPT-2 and the tiny Llama, through chunked prefills, mixed steps, decode rows of
different lengths (padded within a group, and in several groups), cancels, preemption,
and blocks freed and used again. The read slots themselves are checked too: a decode
row's and a later chunk's reads stay within the positions written before them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine import EngineEvent, FinishEvent, GenerationRequest, SamplingParams, paged_batch
from engine.block_allocator import BlockTable
from engine.engine import Engine
from engine.kv_cache import PagedKVCache
from engine.paged_batch import decode_batch, prefill_batch

MODELS = pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
# Few blocks, so that sequences are preempted and freed blocks soon serve others; a small
# prefill budget, so that long prompts come in chunks that read their cached prefix.
OPTIONS = {"max_batch": 6, "num_blocks": 20, "block_size": 4, "max_prefill_tokens": 12}
PROMPTS = [
    "The capital of France is Paris.",
    "A stream is an HTTP response that does not end; tokens leave as they are made.",
    "Every",
    "Les élèves étudient à Genève. Über Straße, naïve café, déjà vu. 日本語のテキスト",
    "0123456789 + - * / = ( ) [ ] { }",
    "Emoji: 🙂🚀 and more 🙂.",
    "The capital of Italy is Rome, and every stream has an owner.",
]
SEEDED = SamplingParams(temperature=1.0, seed=7, ignore_eos=True)
GREEDY = SamplingParams(ignore_eos=True)


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", prompt, 6 + 3 * (i % 4),
                              sampling=SEEDED if i % 3 == 1 else GREEDY)
            for i, prompt in enumerate(PROMPTS)]


@contextmanager
def flooded(engine: Engine, value: float) -> Iterator[list[bool]]:
    """``value`` in every slot now and in every block as it is freed; yields a list that
    gets True for each forward pass whose logits held a NaN."""
    cache: PagedKVCache = engine.runner.cache  # type: ignore[attr-defined]
    cache.fill_for_test(value)
    release = engine.allocator.release

    def release_and_flood(table: BlockTable) -> None:
        release(table)
        if table.block_ids:
            cache.fill_for_test(value, table.block_ids)

    engine.allocator.release = release_and_flood  # type: ignore[method-assign]
    saw_nan: list[bool] = []
    head = engine.runner.model.get_output_embeddings()  # type: ignore[attr-defined]
    hook = head.register_forward_hook(
        lambda _m, _i, out: saw_nan.append(bool(torch.isnan(out).any())))
    try:
        yield saw_nan
    finally:
        hook.remove()


def run(engine: Engine) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Waves of arrivals, a cancel, then everything to the end: ids and finish reasons."""
    batch = requests()
    events: list[EngineEvent] = []
    for request in batch[:4]:
        engine.submit(request)
    for _ in range(4):
        events += engine.step()
    engine.cancel("r1")  # its blocks are freed mid-stream, and flooded
    for request in batch[4:]:
        engine.submit(request)
    for _ in range(500):
        if not engine.has_work():
            break
        events += engine.step()
    ids: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for event in events:
        if isinstance(event, FinishEvent):
            reasons[event.request_id] = event.reason.value
        else:
            ids.setdefault(event.request_id, []).append(event.token_id)
    return ids, reasons


@MODELS
@pytest.mark.parametrize(("mixed_step", "pad_to"), [(True, 16), (True, 2), (False, 16)])
def test_a_cache_of_nan_gives_the_tokens_of_a_cache_of_zeros(
    model: str, mixed_step: bool, pad_to: int, make_tiny_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paged_batch, "PAD_TO", pad_to)  # 2: a group per two lengths
    outcomes = []
    for value in (0.0, float("nan")):
        engine = make_tiny_engine(model, mixed_step=mixed_step, **OPTIONS)
        with flooded(engine, value) as saw_nan:
            outcomes.append(run(engine))
        assert saw_nan and not any(saw_nan), f"a NaN logit with the cache full of {value}"
        stats = engine.statistics()
        assert stats.preemptions > 0  # blocks were taken back and given out again
        assert stats.releases > len(PROMPTS)
    zeros, nans = outcomes
    assert nans == zeros
    assert zeros[1]["r1"] == "cancelled" and set(zeros[1].values()) == {"cancelled", "length"}


def test_fill_for_test_floods_exactly_the_blocks_given() -> None:
    cache = PagedKVCache(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=3,
                         dtype=torch.float32, device=torch.device("cpu"))
    cache.fill_for_test(0.0)
    cache.fill_for_test(float("nan"), [2, 0])
    for tensor in (*cache.keys, *cache.values):
        nan_slots = torch.isnan(tensor).all(dim=(1, 2)).nonzero().flatten().tolist()
        assert nan_slots == [0, 1, 4, 5]
        assert not torch.isnan(tensor[[2, 3, 6, 7]]).any()


def _written(cache: PagedKVCache, table: list[int], length: int) -> set[int]:
    return {table[p // cache.block_size] * cache.block_size + p % cache.block_size
            for p in range(length)}


def test_decode_rows_read_only_positions_written_before(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1,
                         head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    tables = [[7, 1, 0], [3, 12, 0], [5, 0, 0], [14, 2, 11]]  # padded with block 0
    lengths = [9, 6, 2, 12]  # after this step's position is written
    positions = torch.tensor([[n - 1] for n in lengths])
    for padding in (16, 2):  # one group (rows padded), and a group a length
        monkeypatch.setattr(paged_batch, "PAD_TO", padding)
        batch = decode_batch(cache, torch.tensor(tables), positions, torch.float32)
        for group in batch.reads:
            rows = range(len(tables)) if group.rows is None else group.rows.tolist()
            slots = group.slots.view(len(rows), -1).tolist()
            for row, read in zip(rows, slots, strict=True):
                assert set(read) <= _written(cache, tables[row], lengths[row]), (padding, row)


def test_a_later_chunk_reads_only_its_written_prefix_and_itself() -> None:
    cache = PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1,
                         head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    tables = torch.tensor([[4, 9, 2, 0], [6, 0, 0, 0]])
    batch, _ = prefill_batch(cache, tables, [5, 3], starts=[6, 0])
    prefix = batch.prefix_slots[0]
    assert prefix is not None and batch.prefix_slots[1] is None
    assert set(prefix.tolist()) == _written(cache, [4, 9, 2], 11)  # 6 cached + its 5



# Run in a process of its own: in the suite's process, a heap that earlier tests grew
# and freed hands the cache pages that are already resident, and nothing shows (seen in
# a pytest-xdist worker: 0.3 MiB "written").
_MEASURE = """
from pathlib import Path
import torch
from engine.kv_cache import PagedKVCache

def rss_anon():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no RssAnon in /proc/self/status")

before = rss_anon()
cache = PagedKVCache(num_layers=8, num_blocks=2048, block_size=16, num_kv_heads=4,
                     head_dim=16, dtype=torch.float32, device=torch.device("cpu"))
allocated = rss_anon() - before
cache.fill_for_test(1.0, list(range(512)))  # a quarter of the blocks: 32 MiB
print(allocated, rss_anon() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc")
def test_a_cache_commits_memory_only_where_it_is_written() -> None:
    # 8 layers x 2 x 8 MiB = 128 MiB allocated; zeros would commit all of it at once.
    measured = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent.parent)
    allocated, written = map(int, measured.stdout.split())
    assert allocated < 16 * 2**20, allocated
    assert 24 * 2**20 < written < 64 * 2**20, written

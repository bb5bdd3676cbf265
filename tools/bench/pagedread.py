"""Decode attention read through the block table (FlexAttention) against today's gather.

``python -m tools.bench pagedread`` (issue 37 item 4, the reference chapter's exercise
8) fills a paged cache of the embedded model's attention geometry (9 query heads, 3 kv
heads, head dim 64, blocks of 16) with random keys and values, gives 32 rows scattered
block tables, and times one decode attention over them for short (~100 positions) and
long (1,000-4,000) contexts, alternating:

* ``gather``: today's path: ``paged_batch.decode_batch`` (slots, length groups) once, then
  per layer ``attention._decode`` (each group's blocks gathered into a padded tensor);
* ``flex``: ``torch.nn.attention.flex_attention`` compiled by inductor, over the whole
  cache as the keys of every row, with a ``BlockMask`` built from the block table
  (``BlockMask.from_kv_blocks``: a row visits only its own blocks; a mask function cuts
  its last block at its length): nothing is gathered.

The cache holds, by default, just the blocks the rows use (``--cache-positions``: a
server's cache, sized from memory, is larger): the compiled CPU kernel's time grew with
the cache's size, not only with the blocks a row visits. Per context: each side's median
ms for a step's attention over ``--layers`` layers (the metadata or block mask once, then
one call per layer), their ratio, the first flex call's seconds (its compile), the block
mask's own ms and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from engine.attention import _decode
from engine.kv_cache import PagedKVCache
from engine.paged_batch import decode_batch
from tools.bench.common import bench
from tools.lab.common import Report

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CONTEXTS = {"short": (90, 110), "long": (1000, 4000)}


def flex_mask(tables: torch.Tensor, lengths: torch.Tensor, num_blocks: int) -> Any:
    """The block mask of one decode step: row b visits its table's blocks only, the
    full ones unmasked, a partly written last one through the mask function. (Inductor's
    CPU template needs the full blocks given: without them its C++ did not compile.)"""
    from torch.nn.attention.flex_attention import BlockMask

    used = (lengths + BLOCK - 1) // BLOCK
    full = lengths // BLOCK
    last_block = tables.gather(1, (used - 1)[:, None]).flatten()
    last_len = lengths - (used - 1) * BLOCK

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv // BLOCK != last_block[b]) | (kv % BLOCK < last_len[b])

    def wide(columns: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(columns, (0, num_blocks - columns.shape[1]))[
            :, None, None, :].int()

    return BlockMask.from_kv_blocks(
        (used - full)[:, None, None].int(), wide(last_block[:, None]),
        full[:, None, None].int(), wide(tables), BLOCK_SIZE=(1, BLOCK),
        mask_mod=mask_mod, seq_lengths=(1, num_blocks * BLOCK), compute_q_blocks=False)


def case(name: str, cache: PagedKVCache, num_blocks: int, flex: Any,
         args: argparse.Namespace) -> dict[str, Any]:
    """Time both sides over one random batch of ``args.rows`` rows of context ``name``."""
    generator = torch.Generator().manual_seed(len(name))
    low, high = CONTEXTS[name]
    lengths = torch.randint(low, high + 1, (args.rows,), generator=generator)
    widths = (lengths + BLOCK - 1) // BLOCK
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(args.rows, int(widths.max()), dtype=torch.long)
    taken = 0
    for row, width in enumerate(widths.tolist()):
        tables[row, :width] = order[taken: taken + width]
        taken += width
    query = torch.randn(args.rows, HEADS, 1, HEAD_DIM, generator=generator)
    scale = HEAD_DIM ** -0.5
    keys = [k.transpose(0, 1)[None].expand(args.rows, -1, -1, -1) for k in cache.keys]
    values = [v.transpose(0, 1)[None].expand(args.rows, -1, -1, -1) for v in cache.values]

    def gather() -> torch.Tensor:
        batch = decode_batch(cache, tables, (lengths - 1)[:, None], torch.float32)
        outs = [_decode(query, batch, layer, scale) for layer in range(args.layers)]
        return outs[-1].transpose(1, 2)

    def flexed() -> torch.Tensor:
        mask = flex_mask(tables, lengths, num_blocks)
        outs = [flex(query, keys[layer], values[layer], block_mask=mask, scale=scale,
                     enable_gqa=True) for layer in range(args.layers)]
        return outs[-1]

    started = time.perf_counter()
    with torch.inference_mode():
        first = flexed()
    first_s = time.perf_counter() - started
    times: dict[str, list[float]] = {"gather": [], "flex": [], "flex_mask": []}
    with torch.inference_mode():
        diff = float((first - gather()).abs().max())
        for _ in range(args.repeats):
            for side, call in (("gather", gather), ("flex", flexed)):
                started = time.perf_counter()
                call()
                times[side].append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            flex_mask(tables, lengths, num_blocks)
            times["flex_mask"].append((time.perf_counter() - started) * 1000)
    gather_ms, flex_ms = (statistics.median(times[s]) for s in ("gather", "flex"))
    return {"context": name, "positions": [int(lengths.min()), int(lengths.max())],
            "mean_positions": round(float(lengths.float().mean()), 1),
            "gather_ms": round(gather_ms, 2), "flex_ms": round(flex_ms, 2),
            "flex_over_gather": round(flex_ms / gather_ms, 3),
            "flex_mask_ms": round(statistics.median(times["flex_mask"]), 2),
            "first_flex_call_s": round(first_s, 1), "max_abs_diff": diff}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2, help="attention calls per step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--contexts", nargs="+", choices=sorted(CONTEXTS),
                        default=["short", "long"])
    parser.add_argument("--cache-positions", type=int, default=None,
                        help="the cache's size (default: just what the rows need, per context)")


@bench("pagedread", "decode attention through the block table (FlexAttention) vs the gather",
       arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for name in args.contexts:
        positions = args.cache_positions or args.rows * CONTEXTS[name][1]
        num_blocks = -(-positions // BLOCK) + 1
        cache = PagedKVCache(num_layers=args.layers, num_blocks=num_blocks, block_size=BLOCK,
                             num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                             device=torch.device("cpu"))
        for tensor in (*cache.keys, *cache.values):
            tensor.normal_()
        rows.append({**case(name, cache, num_blocks, flex, args),
                     "cache_positions": num_blocks * BLOCK})
    summary: dict[str, Any] = {"rows": args.rows, "layers": args.layers,
                               "threads": torch.get_num_threads()}
    for row in rows:
        summary[f"flex_over_gather_{row['context']}"] = row["flex_over_gather"]
        summary[f"gather_ms_{row['context']}"] = row["gather_ms"]
        summary[f"flex_ms_{row['context']}"] = row["flex_ms"]
        summary[f"cache_positions_{row['context']}"] = row["cache_positions"]
    return Report(summary, {"cases": rows})

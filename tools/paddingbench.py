"""A decode step over rows of different lengths, per padding limit: ``attention.MAX_PADDING``.

``python -m tools.paddingbench [--json FILE]`` loads the embedded model and times decode
passes of ``--batch`` rows whose cached lengths are drawn (seeded) from each ``--spreads``
range, for each padding limit of ``--limits`` (``attention.length_groups``: a row joins a
group of longer rows only if that pads it by at most the limit; a very large limit is
the one padded call of every row), the limits alternated in rounds so that all see the
same load. Reported: the median pass per spread and limit, and the groups it made.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from engine import attention
from engine.block_manager import BlockTable
from engine.model import load_model
from engine.model_runner import ModelRunner
from engine.sequence import Sequence
from engine.types import GenerationRequest

BLOCK_SIZE = 16
ONE_CALL = 1_000_000  # a limit no length difference reaches


def _row(first_block: int, length: int) -> Sequence:
    """A decode row at position ``length - 1`` over blocks of its own."""
    seq = Sequence(GenerationRequest("paddingbench", "", 1), [0] * (length - 1),
                   None, None, None)  # type: ignore[arg-type]  # no text: never recorded
    blocks = list(range(first_block, first_block + length // BLOCK_SIZE + 1))
    seq.block_table = BlockTable("paddingbench", blocks, is_released=True)
    seq.generated_ids = [0]
    return seq


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.paddingbench", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--spreads", nargs="+", default=["60-64", "40-100", "40-300", "40-1000"],
                        help="ranges of cached lengths, LOW-HIGH")
    parser.add_argument("--limits", type=int, nargs="+", default=[ONE_CALL, 256, 64, 16, 0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spreads = [tuple(int(x) for x in s.split("-")) for s in args.spreads]
    longest = max(high for _, high in spreads)
    per_row = longest // BLOCK_SIZE + 1
    loaded = load_model(args.model, "cpu")
    runner = ModelRunner(loaded, num_blocks=args.batch * per_row, block_size=BLOCK_SIZE)
    rng = random.Random(args.seed)
    rows_out = []
    default = attention.MAX_PADDING
    try:
        for low, high in spreads:
            batch = [_row(i * per_row, rng.randint(low, high)) for i in range(args.batch)]
            lengths = [s.num_cached + 1 for s in batch]
            times: dict[int, list[float]] = {limit: [] for limit in args.limits}
            for _ in range(args.rounds):
                for limit in args.limits:
                    attention.MAX_PADDING = limit
                    started = time.perf_counter()
                    runner.decode(batch)
                    times[limit].append((time.perf_counter() - started) * 1000)
            for limit in args.limits:
                attention.MAX_PADDING = limit
                rows_out.append({"spread": f"{low}-{high}", "limit": limit,
                                 "groups": len(attention.length_groups(lengths)),
                                 "median_ms": round(statistics.median(times[limit]), 1)})
                print(json.dumps(rows_out[-1]))
    finally:
        attention.MAX_PADDING = default
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {"model": args.model, "batch": args.batch, "rounds": args.rounds,
                   "engine_max_padding": default}
        args.json.write_text(json.dumps({"summary": summary, "rows": rows_out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

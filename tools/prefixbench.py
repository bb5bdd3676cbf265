"""What a prompt token costs as its prompt's cached prefix grows: ``costs.PREFIX_POSITIONS``.

``python -m tools.prefixbench [--json FILE]`` loads the embedded model and times
mixed forward passes (the engine's step with a prompt chunk beside decode rows): a
chunk of ``--small`` and of ``--large`` tokens starting at each prefix position, beside
``--rows`` decode rows, in rounds that alternate every setting so that all see the
same load. A least-squares fit of the medians to ``fixed + a * n + b * n * p`` (``n``
chunk tokens from prefix ``p``; the decode rows are in ``fixed``) gives the prefix
positions that double a token's cost, ``a / b``: the engine's cost model counts a chunk
of ``n`` tokens from ``p`` as ``n * (1 + p / PREFIX_POSITIONS)`` tokens
(``engine.costs.cost_tokens``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine.block_manager import BlockTable
from engine.costs import PREFIX_POSITIONS
from engine.model import load_model
from engine.model_runner import ModelRunner
from engine.sequence import Chunk, Sequence
from engine.types import GenerationRequest

BLOCK_SIZE = 16


def _sequence(table: BlockTable, prompt: int, generated: int = 0) -> Sequence:
    """A sequence over ``table`` (shared: the writes land where nobody reads)."""
    seq = Sequence(GenerationRequest("prefixbench", "", 1), [0] * prompt,
                   None, None, None)  # type: ignore[arg-type]  # no text: never recorded
    seq.block_table, seq.generated_ids = table, [0] * generated
    return seq


def measure(runner: ModelRunner, table: BlockTable, prefixes: list[int], sizes: tuple[int, int],
            rows: int, rounds: int) -> dict[int, dict[int, float]]:
    """Median ms of a mixed pass, by prefix and chunk size."""
    decode = [_sequence(table, 40, 40) for _ in range(rows)]
    runner.mixed([Chunk(_sequence(table, sizes[0]), 0, sizes[0])], decode)  # warm-up
    times: dict[int, dict[int, list[float]]] = {p: {n: [] for n in sizes} for p in prefixes}
    for _ in range(rounds):
        for p in prefixes:
            for n in sizes:
                started = time.perf_counter()
                runner.mixed([Chunk(_sequence(table, p + n), p, p + n)], decode)
                times[p][n].append((time.perf_counter() - started) * 1000)
    return {p: {n: statistics.median(ms) for n, ms in by.items()} for p, by in times.items()}


def fit(medians: dict[int, dict[int, float]]) -> tuple[float, float, float]:
    """(fixed ms, ms a token at prefix 0, prefix positions that double it: inf where
    the fit finds no growth, or no cost a token)."""
    rows = [(1.0, n, n * p, ms) for p, by in medians.items() for n, ms in by.items()]
    design = np.array([r[:3] for r in rows], dtype=float)
    (fixed, per_token, per_position), *_ = np.linalg.lstsq(
        design, np.array([r[3] for r in rows]), rcond=None)
    if per_token <= 0 or per_position <= 0:  # noise over a cost too small to see
        return fixed, per_token, float("inf")
    return fixed, per_token, per_token / per_position


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.prefixbench", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[0, 250, 500, 750, 1000, 1500])
    parser.add_argument("--small", type=int, default=32)
    parser.add_argument("--large", type=int, default=96)
    parser.add_argument("--rows", type=int, default=16, help="decode rows beside the chunk")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "cpu")
    positions = max(args.prefixes) + args.large
    num_blocks = -(-positions // BLOCK_SIZE)
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    table = BlockTable("prefixbench", list(range(num_blocks)), is_released=True)
    sizes = (args.small, args.large)
    medians = measure(runner, table, args.prefixes, sizes, args.rows, args.rounds)
    fixed, at_zero, doubling = fit(medians)
    result = {
        "model": args.model, "rows": args.rows, "sizes": sizes, "rounds": args.rounds,
        "pass_ms": {str(p): {str(n): round(ms, 1) for n, ms in by.items()}
                    for p, by in medians.items()},
        "fixed_ms": round(fixed, 1),
        "ms_per_token_at_0": round(at_zero, 3),
        "prefix_positions": round(doubling) if doubling != float("inf") else None,  # none seen
        "engine_prefix_positions": PREFIX_POSITIONS,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

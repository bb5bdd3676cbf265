"""``python -m tools.bench linears`` in a seconds-long form: every precision's linear layers
timed in turns, the fastest at each row count, and each shape's calibrated rows per call."""

from __future__ import annotations

import json
from pathlib import Path

from engine.precision import PRECISIONS
from tools.bench.__main__ import main as bench


def test_linears_bench_times_every_precision_at_each_row_count(tmp_path: Path) -> None:
    argv = ["linears", "--quick", "--batches", "1", "4", "--reps", "2", "--out", str(tmp_path)]
    assert bench(argv) == 0
    summary = json.loads((tmp_path / "linears.json").read_text())["summary"]

    assert set(summary["ms_by_precision_and_rows"]) == set(PRECISIONS)
    assert all(ms > 0 for by_rows in summary["ms_by_precision_and_rows"].values()
               for ms in by_rows.values())
    assert set(summary["fastest_by_rows"]) == {"1", "4"}
    assert summary["layers"]["float32"] == 15  # tiny-llama: 7 a block, the output layer
    assert summary["layers"]["int4"] == 13  # each block's gate and up joined in one
    assert set(summary["rows_per_call"]["int4"]) >= {
        "Int4Linear 64->64", "Int4Linear 64->256", "PackedLinear 64->384"}
    assert all(n >= 1 for shapes in summary["rows_per_call"].values() for n in shapes.values())

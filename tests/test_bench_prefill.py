"""``python -m tools.bench prefill`` in a seconds-long form: every variant runs and agrees."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench.__main__ import main as bench


def test_prefill_bench_times_every_variant_and_their_argmax_agrees(tmp_path: Path) -> None:
    argv = ["prefill", "--quick", "--prompts", "4", "--rounds", "1", "--out", str(tmp_path)]
    assert bench(argv) == 0
    report = json.loads((tmp_path / "prefill.json").read_text())
    assert next(iter(report)) == "summary"
    assert [row["variant"] for row in report["rows"]] == [
        "serial", "packed", "masked", "padded", "causal"]
    assert all(row["same_argmax"] for row in report["rows"])
    assert all(row["max_abs_diff"] < 1e-3 for row in report["rows"])
    assert report["summary"]["prompts"] == 4 and report["summary"]["same_argmax"] is True

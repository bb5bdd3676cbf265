"""``python -m tools.bench overhead`` in its seconds-long form: the parts of a decode
step add up to the step, and the greedy pick is timed both ways (the compiled side
takes minutes and is not run here)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench.__main__ import main as bench


def test_overhead_bench_breaks_a_step_into_parts_that_fit_in_it(tmp_path: Path) -> None:
    argv = ["overhead", "--quick", "--compile", "none", "--batches", "1", "3",
            "--steps", "3", "--warmup", "1", "--out", str(tmp_path)]
    assert bench(argv) == 0
    report = json.loads((tmp_path / "overhead.json").read_text())
    assert list(report)[:2] == ["summary", "meta"]
    assert report["compiled"] == []
    for batch in ("1", "3"):
        parts = report["breakdown"][batch]
        assert 0 < parts["model_body"] <= parts["forward"] < parts["step"]
        assert parts["sampling"] > 0 and parts["batch_metadata"] > 0
        assert parts["greedy_argmax_ms"] > 0 and parts["greedy_max_ms"] > 0
        assert 0 < report["summary"]["ours_share"][batch] < 1

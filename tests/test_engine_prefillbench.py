"""``python -m tools.prefillbench`` in a seconds-long form: every variant runs and agrees."""

from __future__ import annotations

import json
from pathlib import Path

from tools import prefillbench


def test_prefillbench_times_every_variant_and_their_argmax_agrees(tmp_path: Path) -> None:
    out = tmp_path / "prefillbench.json"
    argv = ["--model", "tiny-llama", "--prompts", "4", "--rounds", "1", "--json", str(out)]
    assert prefillbench.main(argv) == 0
    report = json.loads(out.read_text())
    assert [row["variant"] for row in report["rows"]] == ["serial", "packed", "masked", "padded"]
    assert all(row["same_argmax"] for row in report["rows"])
    assert all(row["max_abs_diff"] < 1e-3 for row in report["rows"])
    assert report["summary"]["prompts"] == 4

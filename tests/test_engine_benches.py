"""``python -m tools.burstbench`` in a seconds-long form."""

from __future__ import annotations

import json
from pathlib import Path

from tools import burstbench


def test_burstbench_long_reports_two_long_prompts_and_the_margin(tmp_path: Path) -> None:
    out = tmp_path / "burstbench.json"
    argv = ["--model", "tiny-llama", "--scenarios", "long", "--settings", "step-target-mixed",
            "--long-tokens", "300", "--step-ms", "50", "--json", str(out)]
    assert burstbench.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    long = row["long"]
    assert long["long_prompt_tokens"] == 300
    assert long["long_ttft"] > 0 and long["gap_max"] >= long["gap_p50"] > 0
    (again,) = long["again"]
    assert again["long_ttft"] > 0 and again["margin_at_arrival"] > 0



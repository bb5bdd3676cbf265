"""``python -m tools.bench``: the runner, and the step and burst benches in seconds-long forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench.__main__ import main as bench


def test_burst_bench_long_reports_two_long_prompts_and_the_margin(tmp_path: Path) -> None:
    argv = ["burst", "--quick", "--scenarios", "long", "--settings", "step-target-mixed",
            "--long-tokens", "300", "--step-ms", "50", "--out", str(tmp_path)]
    assert bench(argv) == 0
    (row,) = json.loads((tmp_path / "burst.json").read_text())["rows"]
    long = row["long"]
    assert long["long_prompt_tokens"] == 300
    assert long["long_ttft"] > 0 and long["gap_max"] >= long["gap_p50"] > 0
    (again,) = long["again"]
    assert again["long_ttft"] > 0 and again["margin_at_arrival"] > 0




def test_step_bench_writes_the_summary_first_and_a_row_per_batch(tmp_path: Path) -> None:
    argv = ["step", "--quick", "--batches", "1", "2", "--steps", "2", "--warmup", "1",
            "--out", str(tmp_path)]
    assert bench(argv) == 0
    report = json.loads((tmp_path / "step.json").read_text())
    assert list(report)[:2] == ["summary", "meta"]
    assert [row["batch"] for row in report["rows"]] == [1, 2]
    assert report["summary"]["engine_ms_by_batch"]["2"] > 0
    assert report["meta"]["options"]["model"] == "tiny-llama"


def test_recompute_bench_rebuilds_streams_that_continue_as_the_whole_one(
    tmp_path: Path,
) -> None:
    argv = ["recompute", "--quick", "--precision", "bfloat16", "--after", "3", "9",
            "--rounds", "1", "--out", str(tmp_path)]
    assert bench(argv) == 0
    report = json.loads((tmp_path / "recompute.json").read_text())
    assert report["summary"]["continuations_equal"] is True
    assert [row["after"] for row in report["rows"]] == [3, 9]
    assert all(row["rebuilt_ms"] > 0 and row["fresh_prefill_ms"] > 0 for row in report["rows"])


def test_the_runner_lists_every_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        bench(["--list"])
    assert done.value.code == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {"step", "prefill", "burst", "prefixcache", "recompute", "int8compile"} <= listed


def test_penalties_bench_reports_a_row_per_batch(tmp_path: Path) -> None:
    argv = ["penalties", "--batches", "1", "4", "--vocab", "500", "--prompt", "8",
            "--generated", "16", "--rounds", "2", "--out", str(tmp_path)]
    assert bench(argv) == 0
    report = json.loads((tmp_path / "penalties.json").read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 4]
    assert all(row["plain_us"] > 0 and row["penalised_ms"] > 0 for row in report["rows"])

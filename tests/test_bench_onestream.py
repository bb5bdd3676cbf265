"""``python -m tools.bench onestream`` in its seconds-long form: every side of the
alternation is timed, and the engine step's parts fit inside it, step by step."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench.__main__ import main as bench


def test_onestream_bench_times_every_pass_and_parts_that_fit_in_a_step(tmp_path: Path) -> None:
    argv = ["onestream", "--quick", "--precision", "int4", "--batches", "1", "2",
            "--steps", "3", "--warmup", "1", "--out", str(tmp_path)]
    assert bench(argv) == 0
    report = json.loads((tmp_path / "onestream.json").read_text())
    summary = report["summary"]

    assert summary["precision"] == "int4"
    for batch in ("1", "2"):
        assert summary["engine_ms_by_batch"][batch] > 0
        assert summary["library_ms_by_batch"][batch] > 0
        assert summary["python_layers_ms_by_batch"][batch] > 0
        assert summary["engine_over_python_layers"][batch] > 0
        parts = summary["engine_parts_ms"][batch]
        assert 0 < parts["forward"] < parts["step"]
        assert all(parts[k] > 0 for k in ("body_linears", "output_layer", "attention"))
        # each step's own remainder (medians of parts need not add up to a median)
        assert parts["rest_of_forward"] >= 0 and parts["outside_forward"] >= 0


def test_the_profile_names_the_int4_kernel_among_a_step_s_operators(tmp_path: Path) -> None:
    argv = ["onestream", "--quick", "--precision", "int4", "--batches", "1", "--steps", "3",
            "--warmup", "1", "--profile", "--out", str(tmp_path)]
    assert bench(argv) == 0
    summary = json.loads((tmp_path / "onestream.json").read_text())["summary"]
    operators = summary["profile_ms_per_step"]["1"]
    assert "aten::_weight_int4pack_mm_for_cpu" in operators  # the body's layers run on it
    assert all(ms >= 0 for ms in operators.values())
    assert summary["profile_step_ms"]["1"] > 0

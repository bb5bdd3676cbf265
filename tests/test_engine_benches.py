"""``python -m tools.prefixbench``, ``tools.burstbench`` and ``tools.paddingbench`` in
seconds-long forms."""

from __future__ import annotations

import json
from pathlib import Path

from engine import attention
from tools import burstbench, paddingbench, prefixbench


def test_prefixbench_fits_a_cost_per_token_and_the_positions_that_double_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "prefixbench.json"
    argv = ["--model", "tiny-llama", "--prefixes", "0", "64", "128", "--small", "8",
            "--large", "24", "--rows", "2", "--rounds", "1", "--json", str(out)]
    assert prefixbench.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["pass_ms"]) == {"0", "64", "128"}
    assert all(ms > 0 for by in report["pass_ms"].values() for ms in by.values())
    # a tiny model's passes cost next to nothing: the fit may find only noise (None)
    assert report["prefix_positions"] is None or report["prefix_positions"] > 0


def test_prefixbench_fit_recovers_a_known_doubling() -> None:
    medians = {p: {n: 100 + 2.0 * n * (1 + p / 1500) for n in (32, 96)} for p in (0, 500, 1000)}
    fixed, per_token, doubling = prefixbench.fit(medians)
    assert (round(fixed, 6), round(per_token, 6), round(doubling)) == (100, 2.0, 1500)
    flat = {p: {n: 100 - 0.001 * n for n in (32, 96)} for p in (0, 500, 1000)}
    assert prefixbench.fit(flat)[2] == float("inf")  # no cost a token: no doubling


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


def test_paddingbench_times_each_limit_and_counts_its_groups(tmp_path: Path) -> None:
    out = tmp_path / "paddingbench.json"
    argv = ["--model", "tiny-llama", "--batch", "4", "--spreads", "5-40", "--limits",
            "1000000", "0", "--rounds", "1", "--json", str(out)]
    assert paddingbench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["limit"], r["groups"] > 1) for r in rows] == [(1000000, False), (0, True)]
    assert all(r["median_ms"] > 0 for r in rows)
    # the limits were tried, and the engine's own is back
    assert json.loads(out.read_text())["summary"]["engine_max_padding"] == attention.MAX_PADDING

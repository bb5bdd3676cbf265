"""``python -m tools.bench lookup``: prompt lookup's passes counted right, and the bench's
seconds-long form reports every draft length with a cost for every row count."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench.__main__ import main as bench
from tools.bench.lookup import passes


def test_a_pass_accepts_the_guesses_the_answer_repeats_and_makes_one_token_more() -> None:
    # the answer repeats the prompt: nothing to look up at first, then runs of two
    made = passes([5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 5, 6, 7], drafts=2)
    assert made == [(0, 1), (2, 3), (2, 3), (2, 1)]  # the last pass: one token left
    assert sum(tokens for _, tokens in made) == 8


def test_a_guess_that_is_wrong_costs_its_row_and_makes_one_token() -> None:
    # the prompt ends with 1, seen before followed by 2 3 1: three guesses, all wrong
    made = passes([1, 2, 3, 1], [9, 8], drafts=3)
    assert made[0] == (3, 1)
    assert sum(tokens for _, tokens in made) == 2


def test_the_bench_projects_every_draft_length_from_measured_costs(tmp_path: Path) -> None:
    argv = ["lookup", "--quick", "--prompts", "2", "--max-new-tokens", "8", "--drafts", "1", "2",
            "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    assert bench(argv) == 0
    summary = json.loads((tmp_path / "lookup.json").read_text())["summary"]
    assert set(summary["step_ms_by_rows"]) == {"1", "2", "3"}
    assert summary["step_cost_by_rows"]["1"] == 1.0
    for drafts in ("1", "2"):
        figures = summary["by_drafts"][drafts]
        assert 1.0 <= figures["tokens_per_pass"] <= int(drafts) + 1
        assert 1.0 <= figures["rows_per_pass"] <= int(drafts) + 1
        assert figures["projected_speedup"] > 0

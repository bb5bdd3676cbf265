"""``python -m tools.lab precision``'s parts, in-process on the tiny Llama: the runs of one
precision, and how answers are compared (first divergence, the top-2 margins there)."""

from __future__ import annotations

from tools.lab.precision import _run_precision, compare
from tools.prompts import load_prompts


def _answer(ids: list[int], margins: list[float]) -> dict[str, object]:
    return {"ids": ids, "text": "", "margins": margins}


def test_compare_reports_the_first_divergence_with_both_runs_margins() -> None:
    reference = [_answer([1, 2, 3], [5.0, 0.01, 2.0]), _answer([4, 5], [1.0, 1.0])]
    other = [_answer([1, 9, 3], [5.0, 0.02, 2.0]), _answer([4, 5], [1.0, 1.0])]

    result = compare(reference, other)

    assert (result["identical"], result["of"], result["identical_share"]) == (1, 2, 0.5)
    assert result["first_difference_median"] == 1
    assert result["rows"][0] == {"prompt": 0, "identical": False, "first_difference": 1,
                                 "margin_reference": 0.01, "margin_other": 0.02}
    assert result["rows"][1]["first_difference"] is None


def test_one_precision_s_concurrent_answers_equal_its_solo_ones_with_margins() -> None:
    prompts = load_prompts()[:3]
    run = _run_precision("tiny-llama", "bfloat16", prompts, prompts[:2], 5)

    for mode, count in (("greedy", 3), ("seeded", 2)):
        solo, concurrent = run["solo"][mode], run["concurrent"][mode]
        assert compare(solo, concurrent)["identical"] == count
        assert all(len(a["ids"]) == 5 and len(a["margins"]) == 5 for a in solo)
        assert all(m >= 0 for a in solo for m in a["margins"])
    assert run["solo"]["greedy"] != run["solo"]["seeded"][:2] + run["solo"]["greedy"][2:]
    assert run["step_ms_1"] > 0 and run["step_ms_batch"] > 0

"""Calibration of the rows a kernel may take in one call (``engine.batch_invariance``),
on any machine: fake kernels that change their bits past k rows, for a row alone, or
for a few rows only stand for a CPU's.

The real kernels' calibration on this CPU is tests/test_cpu_linear.py; what a refused
precision looks like at start is tests/test_engine_precision.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import engine
from engine.batch_invariance import MAX_ROWS_PER_CALL, calibrate, exact_rows
from engine.cpu_linear import _RowWise


class ChangesPastK(_RowWise):
    """An exact product (small integer weights, float64 sums of bfloat16 rows: no
    rounding, so no order of the sums matters) whose every call of more than ``k`` rows
    adds a different tiny offset (as a kernel whose blocking changes with the rows does
    to the last bits): with k = 0 not even a row alone repeats. ``rare``: only rows
    whose last value is above 1.5 get the offset (5 of the calibration's 64 probe rows,
    the first of them the 26th), as only rows near a rounding boundary show a kernel's
    other path."""

    def __init__(self, out_features: int, in_features: int, k: int,
                 rare: bool = False) -> None:
        super().__init__(out_features, in_features, None)
        self.weight = torch.randint(-3, 4, (out_features, in_features), dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(out_features))
        self.k, self.rare, self.calls = k, rare, itertools.count(1)

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.double() @ self.weight.t()
        if len(rows) <= self.k:
            return out
        shown = (rows[:, -1:] > 1.5).double() if self.rare else 1.0
        return out + next(self.calls) * 1e-3 * shown


class AloneDiffers(ChangesPastK):
    """Exact in every call of two rows or more; a row alone goes another way (its own
    offset), as oneDNN's bfloat16 kernel on an AMD EPYC computes the 1,536-to-576
    projection of a lone row (issue 44)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__(out_features, in_features, k=1_000)

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        out = super()._call(rows)
        return out + 1e-3 if len(rows) == 1 else out


@pytest.mark.parametrize("k", [1, 5, 13, MAX_ROWS_PER_CALL - 1])
def test_calibration_picks_the_largest_call_that_keeps_every_rows_bits(k: int) -> None:
    first, same, other = ChangesPastK(24, 16, k), ChangesPastK(24, 16, k), ChangesPastK(8, 16, 3)

    limits = calibrate([first, same, other], "fake")

    assert limits == {("ChangesPastK", 24, 16): (1, k), ("ChangesPastK", 8, 16): (1, 3)}
    assert (first.rows_per_call, same.rows_per_call, other.rows_per_call) == (k, k, 3)


@pytest.mark.parametrize("k", [2, 5, 13])
def test_every_size_is_checked_on_every_probe_row_not_only_its_first_rows(k: int) -> None:
    # A size checked on the first n probe rows alone passes where none of them is one
    # the kernel's other path shows on (the first calibration's flaw: it set 27 on the
    # AMD projection whose every size past one differed).
    layer = ChangesPastK(24, 16, k, rare=True)

    assert calibrate([layer], "fake") == {("ChangesPastK", 24, 16): (1, k)}


def test_a_kernel_that_computes_a_row_alone_by_another_path_gets_calls_of_two_rows() -> None:
    layer = AloneDiffers(24, 16)
    rows = torch.randn(70, 16, generator=torch.Generator().manual_seed(2)).bfloat16()

    assert calibrate([layer], "fake") == {("AloneDiffers", 24, 16): (2, MAX_ROWS_PER_CALL)}
    with torch.inference_mode():
        solo = torch.cat([layer(rows[i : i + 1]) for i in range(len(rows))])
        for count in (1, 2, 3, 33, 65, 70):  # 33 and 65: a last slice of one row
            assert torch.equal(layer(rows[:count]), solo[:count]), count
        layer.min_rows_per_call = 1  # a row alone as the kernel computes it
        assert not torch.equal(layer(rows[:1]), solo[:1])


def test_a_calibrated_layer_gives_every_row_its_solo_bits_in_any_batch() -> None:
    layer = ChangesPastK(24, 16, 12)
    rows = torch.randn(100, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode():
        calibrate([layer], "fake")
        solo = torch.cat([layer(rows[i : i + 1]) for i in range(len(rows))])
        for count in (12, 13, 25, 100):
            assert torch.equal(layer(rows[:count]), solo[:count]), count
        layer.rows_per_call = 32  # the size once assumed for every CPU
        assert not torch.equal(layer(rows[:32]), solo[:32])


def test_a_kernel_exact_at_every_size_tried_gets_the_largest() -> None:
    assert exact_rows(ChangesPastK(8, 16, 1000), max_rows=20) == (1, 20)


def test_a_kernel_with_no_exact_size_is_refused_naming_the_precision() -> None:
    exact, never = ChangesPastK(24, 16, 4), ChangesPastK(8, 16, 0)

    with pytest.raises(engine.PrecisionError) as caught:
        calibrate([exact, never], "int4")

    assert str(caught.value) == ("int4 is not exact on this CPU: its ChangesPastK kernel "
                                 "(16 to 8) does not give a row the same bits twice alone")
    assert "\n" not in str(caught.value)
    assert exact.rows_per_call == 1  # nothing was set: the model is left as it was

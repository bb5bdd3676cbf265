"""``python -m tools.bench int8compile``: its invariance probe, and its refusal of a run
that would compare nothing. (Compiling the layers takes a minute and is not run here;
docs/results.md has its figures.)"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from engine.cpu_linear import Int8Linear
from tools.bench.__main__ import main as bench
from tools.bench.int8compile import rows_invariant


def test_the_probe_passes_the_eager_int8_kernel() -> None:
    layer = Int8Linear(torch.nn.Linear(64, 48))
    probe = rows_invariant(types.MethodType(Int8Linear._call, layer), 64, 40)
    assert probe == {"invariant": True, "first_differing_rows": None}


def test_the_probe_finds_a_row_that_depends_on_its_batch() -> None:
    def batch_scaled(rows: torch.Tensor) -> torch.Tensor:
        """A product whose rows share one scale: a row changes once a larger one joins."""
        scale = rows.abs().amax()
        return (rows / scale).round() * scale

    probe = rows_invariant(batch_scaled, 16, 40)
    assert probe["invariant"] is False and 2 <= probe["first_differing_rows"] <= 40


def test_it_refuses_another_precision(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--precision int8"):
        bench(["int8compile", "--quick", "--out", str(tmp_path)])

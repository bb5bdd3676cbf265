"""How many rows a CPU kernel may take in one call and still give every row its solo bits.

The identity the engine promises (a concurrent answer equals its solo run, bit for bit)
rests on one property of the linear layers (``engine.cpu_linear``): a row's output is the
same whether it is computed alone or among other rows. A kernel keeps it only up to some
number of rows a call, and that number is the CPU's, not ours: oneDNN's bfloat16 kernel
on a Xeon with AMX keeps it up to 32 rows, on an AMD EPYC without AMX (AVX-512 BF16) the
1,536-to-576 projection loses it at 13 (issue 44). So it is measured, at load, on the CPU
the engine runs on, rather than assumed:

* for each distinct linear layer of the model (its kind and shape: SmolLM2-135M has
  five, the 210 layers share them), a layer of that kind and shape computes seeded random
  rows one at a time (each row's solo result), then in one call of every size the engine
  can make (1 up to ``MAX_ROWS_PER_CALL``: a layer slices larger calls into these);
* the largest size up to which every call gives every row its solo bits is that shape's
  ``rows_per_call``, set on every layer of the shape and logged;
* a kernel that does not even repeat a row alone (a nondeterministic kernel) has none:
  ``calibrate`` raises ``PrecisionError``, and the precision is refused at start (``auto``
  then takes the next one: ``engine.precision``).

It costs a few hundred rows through each shape (the vocabulary-wide output layer most):
1-3 s on the 2-core machine. So, like the step-cost calibration, a start keeps its result
(``start_cache``: the same CPU, torch threads and versions, model files and engine code)
and a later start like it reads it; an engine built directly (the tests') always
measures. The tests drive it with a fake kernel that
changes its bits past k rows (tests/test_batch_invariance.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from . import start_cache
from .cpu_linear import _RowWise
from .errors import PrecisionError
from .startup import phase

logger = logging.getLogger(__name__)

# The largest call tried: calls past it bring little (a decode step of 32 rows is one
# call per layer), and each size tried costs its rows once at load.
MAX_ROWS_PER_CALL = 32
SEED = 44


def shape_key(layer: _RowWise) -> tuple[str, int, int]:
    """What a kernel's blocking can depend on: the layer's kind and (out, in) shape."""
    return type(layer).__name__, layer.out_features, layer.in_features


def exact_rows(layer: _RowWise, max_rows: int = MAX_ROWS_PER_CALL,
               dtype: torch.dtype = torch.bfloat16) -> int:
    """The largest n <= ``max_rows`` such that calls of 1..n rows through ``layer``'s
    kernel give each row its solo result bit for bit; 0 if a row alone does not repeat."""
    generator = torch.Generator().manual_seed(SEED)
    rows = torch.randn(max_rows, layer.in_features, generator=generator).to(dtype)
    with torch.inference_mode():
        solo = torch.cat([layer._call(rows[i : i + 1]) for i in range(max_rows)])
        if not torch.equal(layer._call(rows[:1]), solo[:1]):
            return 0
        for count in range(2, max_rows + 1):
            if not torch.equal(layer._call(rows[:count]), solo[:count]):
                return count - 1
    return max_rows


def calibrate(
    layers: Iterable[_RowWise], precision: str, max_rows: int = MAX_ROWS_PER_CALL,
    measure: Callable[[_RowWise, int], int] | None = None,
) -> dict[tuple[str, int, int], int]:
    """Measure each distinct shape among ``layers`` once (its first layer), set every
    layer's ``rows_per_call`` to its shape's, log them, and return them; raise
    ``PrecisionError`` naming ``precision`` if a shape has no exact call size.
    ``measure``: ``exact_rows`` (looked up at the call: tests stand a CPU's in for it)."""
    measure = measure or exact_rows
    layers = list(layers)
    shapes = sorted({shape_key(layer) for layer in layers})
    detail = {"precision": precision, "max_rows": max_rows,
              "shapes": [list(shape) for shape in shapes]}  # as JSON reads it back
    saved = (start_cache.load("batch_invariance", detail) or {}).get("rows")
    reused = isinstance(saved, list) and len(saved) == len(shapes)
    if reused:
        assert isinstance(saved, list)
        limits = {shape: int(rows) for shape, rows in zip(shapes, saved, strict=True)}
    else:
        limits = {}
        with phase("batch_invariance"):
            for layer in layers:
                key = shape_key(layer)
                if key not in limits:
                    limits[key] = measure(layer, max_rows)
    broken = [key for key, rows in limits.items() if rows < 1]
    if not broken and not reused:  # a refusal is measured again at the next start
        start_cache.save("batch_invariance", detail, {"rows": [limits[s] for s in shapes]})
    if broken:
        kind, out_features, in_features = broken[0]
        raise PrecisionError(
            f"{precision} is not exact on this CPU: its {kind} kernel ({in_features} to "
            f"{out_features}) does not give a row the same bits twice alone")
    for layer in layers:
        layer.rows_per_call = limits[shape_key(layer)]
    logger.info("batch invariance (%s): rows per call %s", precision, ", ".join(
        f"{kind} {in_f}->{out_f}: {rows}" for (kind, out_f, in_f), rows in limits.items()))
    return limits

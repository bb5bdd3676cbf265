"""Which calls a CPU kernel may take and still give every row its solo bits.

The identity the engine promises (a concurrent answer equals its solo run, bit for bit)
rests on one property of the linear layers (``engine.cpu_linear``): a row's output is the
same whether it is computed alone or among other rows. A kernel keeps it only for some
call sizes, and those are the CPU's, not ours: oneDNN's bfloat16 kernel on a Xeon with
AMX keeps it up to 32 rows; on an AMD EPYC without AMX (AVX-512 BF16) it computes a row
alone of the 1,536-to-576 projection by another path than any call of 2 to 256 rows
(issue 44). So the sizes are measured, at load, on the CPU the engine runs on, rather
than assumed:

* for each distinct linear layer of the model (its kind and shape: SmolLM2-135M has
  five, the 210 layers share them), a layer of that kind and shape computes
  ``PROBE_ROWS`` seeded random rows one at a time (each row's solo result), then all of
  them again in calls of each size the engine can make, 2 up to ``MAX_ROWS_PER_CALL`` (a
  layer slices larger calls into these). Every size sees every probe row: a kernel's
  other path changes a row's last bits only where its float32 sum lies near a bfloat16
  rounding boundary (one random row in eleven, above), so a size checked on a few rows
  passes by luck (the first version checked size n on the first n rows and set 27 on
  that AMD projection, whose every size past one differed);
* the largest size up to which every call gives every row its solo bits is that shape's
  ``rows_per_call``, set on every layer of the shape and logged;
* where a row alone is the odd one out, the same is measured with every call at least
  two rows (a row alone padded with a zero row: ``_RowWise._sliced``), and that floor
  (``min_rows_per_call``) is kept where it allows larger calls than none does;
* a kernel that does not even repeat a row alone (a nondeterministic kernel) has no
  exact size: ``calibrate`` raises ``PrecisionError``, and the precision is refused at
  start (``auto`` then takes the next one: ``engine.precision``).

It costs some 250 calls through each shape (the vocabulary-wide output layer's the
most): seconds on the 2-core machine (the ``batch_invariance`` start phase). So, like
the step-cost calibration, a start keeps its result (``start_cache``: the same CPU,
torch threads and versions, model files and engine code) and a later start like it
reads it; an engine built directly (the tests') always measures. The tests drive it
with fake kernels that change their bits past k rows, for a row alone, or for a few
rows only (tests/test_batch_invariance.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from . import start_cache
from .cpu_linear import _RowWise
from .errors import PrecisionError
from .startup import phase

logger = logging.getLogger(__name__)

# The largest call tried: calls past it bring little (a decode step of 32 rows is one
# call per layer), and each size tried costs its calls at load.
MAX_ROWS_PER_CALL = 32
# Rows every size is checked on: at one row in eleven (the AMD projection above) 64
# random rows all miss a path's difference once in 450 shapes; the load pays for each.
PROBE_ROWS = 64
FLOORS = (1, 2)  # the fewest rows a call may take: a row alone, or padded to two
SEED = 44


class CallSizes(NamedTuple):
    """The calls a kernel keeps every row's solo bits in: ``fewest`` to ``most`` rows
    (``most`` 0: not even a row alone repeats)."""

    fewest: int
    most: int


def shape_key(layer: _RowWise) -> tuple[str, int, int]:
    """What a kernel's blocking can depend on: the layer's kind and (out, in) shape."""
    return type(layer).__name__, layer.out_features, layer.in_features


def exact_rows(layer: _RowWise, max_rows: int = MAX_ROWS_PER_CALL,
               dtype: torch.dtype = torch.bfloat16) -> CallSizes:
    """The call sizes through ``layer``'s kernel that give every probe row its solo
    result bit for bit: for each floor of ``FLOORS``, the largest n <= ``max_rows``
    such that calls of floor..n rows do; the floor that allows the largest n (the
    smaller on a tie). ``CallSizes(1, 0)`` if a row alone does not repeat."""
    generator = torch.Generator().manual_seed(SEED)
    rows = torch.randn(PROBE_ROWS, layer.in_features, generator=generator).to(dtype)
    best = CallSizes(1, 0)
    with torch.inference_mode():
        for fewest in FLOORS:
            most = _exact_up_to(layer, rows, fewest, max_rows)
            if most > best.most:
                best = CallSizes(fewest, most)
            if best.most == max_rows:
                break
    return best


def _exact_up_to(layer: _RowWise, rows: torch.Tensor, fewest: int, max_rows: int) -> int:
    """The largest n <= ``max_rows`` such that calls of ``fewest``..n rows give every
    one of ``rows`` the bits it gets alone (a call of ``fewest``); 0 if alone twice
    differ."""
    solo = torch.cat([layer._sliced(row, fewest, fewest) for row in rows.split(1)])
    if not torch.equal(layer._sliced(rows[:1], fewest, fewest), solo[:1]):
        return 0
    for count in range(2, max_rows + 1):
        if not torch.equal(layer._sliced(rows, fewest, count), solo):
            return count - 1
    return max_rows


def calibrate(
    layers: Iterable[_RowWise], precision: str, max_rows: int = MAX_ROWS_PER_CALL,
    measure: Callable[[_RowWise, int], CallSizes] | None = None,
) -> dict[tuple[str, int, int], CallSizes]:
    """Measure each distinct shape among ``layers`` once (its first layer), set every
    layer's ``min_rows_per_call`` and ``rows_per_call`` to its shape's, log them, and
    return them; raise ``PrecisionError`` naming ``precision`` if a shape has no exact
    call size. ``measure``: ``exact_rows`` (looked up at the call: tests stand a CPU's
    in for it)."""
    measure = measure or exact_rows
    layers = list(layers)
    shapes = sorted({shape_key(layer) for layer in layers})
    detail = {"precision": precision, "max_rows": max_rows, "probe_rows": PROBE_ROWS,
              "shapes": [list(shape) for shape in shapes]}  # as JSON reads it back
    saved = (start_cache.load("batch_invariance", detail) or {}).get("calls")
    reused = isinstance(saved, list) and len(saved) == len(shapes)
    if reused:
        assert isinstance(saved, list)
        limits = {shape: CallSizes(*map(int, sizes))
                  for shape, sizes in zip(shapes, saved, strict=True)}
    else:
        limits = {}
        with phase("batch_invariance"):
            for layer in layers:
                key = shape_key(layer)
                if key not in limits:
                    limits[key] = measure(layer, max_rows)
    broken = [key for key, sizes in limits.items() if sizes.most < 1]
    if not broken and not reused:  # a refusal is measured again at the next start
        start_cache.save("batch_invariance", detail,
                         {"calls": [list(limits[s]) for s in shapes]})
    if broken:
        kind, out_features, in_features = broken[0]
        raise PrecisionError(
            f"{precision} is not exact on this CPU: its {kind} kernel ({in_features} to "
            f"{out_features}) does not give a row the same bits twice alone")
    for layer in layers:
        layer.min_rows_per_call, layer.rows_per_call = limits[shape_key(layer)]
    logger.info("batch invariance (%s): rows per call %s", precision, ", ".join(
        f"{kind} {in_f}->{out_f}: {sizes.fewest}..{sizes.most}"
        for (kind, out_f, in_f), sizes in limits.items()))
    return limits

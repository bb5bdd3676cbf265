"""What a step's forward passes cost, measured, for the step-time budget.

Theory of operation. A step runs a prefill pass over the prompt chunks chosen
for it and a decode pass over every other running sequence: two forward passes,
or (a mixed step) ONE pass carrying both. Their times are observed after every
step (and once at start up, by ``Engine.calibrate``) and fitted:

* a prefill pass of ``n`` tokens costs ``fixed + per_token * n`` milliseconds, a
  least-squares line through the most recent passes (its fixed part is the pass
  overhead: streaming the weights once, the per-layer Python and kernel launches
  a pass pays at any size; about 100 ms of the embedded model on the 2-core CPU);
* a decode pass at batch ``b`` costs what passes at that batch size cost lately
  (a moving average per size), interpolated between the sizes seen; it holds the
  attention over each row's cached positions;
* a mixed pass of ``n`` prompt tokens and ``b`` decode rows costs the decode pass
  at ``b`` plus ``extra + per_token * n``: a second line, fitted through what the
  mixed passes cost beyond their decode pass. Its ``extra`` is near 0 where the
  prefill line's ``fixed`` was the price of the second pass (until a mixed pass is
  seen, the two-pass cost stands in: an upper bound).

A chunk's tokens also attend over their prompt's cached prefix, so a late chunk of a
long prompt costs more a token: ``cost_tokens`` counts a chunk of ``n`` tokens from
position ``p`` as ``n * (1 + p / PREFIX_POSITIONS)`` tokens, in the observations
(so ``per_token`` stays the cost of a token with no prefix) and, with a step-time
target, in the scheduler's budget (``tokens_within`` cuts a late chunk shorter).

``prefill_tokens_within(target_ms, decode_rows, mixed)`` then says how many
prompt tokens a step may carry so that it stays within ``target_ms`` with its
decode rows, and ``step_line`` gives ``Engine.estimate_ttft_ms`` the same model.

A fitted line is right on average, so a step filled to the target by it overruns the
target about every other time, and more where the model is off (a long prefix, the
step's own Python around its pass). The scheduler plans such steps within the target
over ``margin()``: how much longer than planned (``planned_ms``) recent steps with
prompt tokens and decode rows ran, at the ``MARGIN_QUANTILE``, whole steps measured
(``observe_step``). Planned too long, the margin falls below 1 and steps carry more.

Pure Python, no torch; the numbers are only as good as the machine is steady, so
the fit keeps adapting. Thread-safe: the stepping thread observes while
another may estimate (``Engine.estimate_ttft_ms``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from . import start_cache
from .block_allocator import BlockTable
from .model_side import Runner
from .sequence import Chunk, Sequence
from .startup import phase
from .types import GenerationRequest

WINDOW = 64  # prefill passes in the fit: about a minute of bursts, forgetting older load
# Cached prefix positions that double a chunk token's cost, measured on the embedded model
# (2-core CPU, one torch thread) by tools/prefixbench.py at a0b2ba5 --threads 1: chunks of 32
# and 96 tokens at prefixes 0-1,500 beside 16 decode rows, three runs: 2,254, 2,052, 1,999.
PREFIX_POSITIONS = 2100
DECODE_WEIGHT = 0.2  # each new decode time's weight in its batch size's moving average
MARGIN_WINDOW = 32  # planned steps whose overrun sets the margin
MARGIN_QUANTILE = 0.95  # of their actual / planned times: all but one of 32 stayed within
MARGIN_MIN_SAMPLES = 4  # before as many, the margin is 1
MARGIN_BOUNDS = (0.5, 2.0)  # a stalled machine's odd step does not halve the budget for long
# A saved calibration is reused when the check's decode pass at max_batch took within this
# factor of what the saved one says (either way); else the start calibrates afresh.
REUSE_TOLERANCE = 1.5
_T = TypeVar("_T")
_R = TypeVar("_R")


class StepCosts:
    def __init__(self) -> None:
        self._prefills: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._mixed: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens, ms over decode)
        self._decode_ms: dict[int, float] = {}
        self._overruns: deque[float] = deque(maxlen=MARGIN_WINDOW)  # actual / planned
        self._lock = threading.Lock()  # guards the four

    def observe_prefill(self, tokens: int, ms: float) -> None:
        with self._lock:
            self._prefills.append((tokens, ms))

    def observe_mixed(self, tokens: int, rows: int, ms: float) -> None:
        """A mixed pass of ``tokens`` prompt tokens and ``rows`` decode rows took ``ms``."""
        decode = self.decode_ms(rows)
        if decode is not None:  # what it cost beyond its decode rows' own pass
            with self._lock:
                self._mixed.append((tokens, ms - decode))

    def observe_decode(self, rows: int, ms: float) -> None:
        with self._lock:
            old = self._decode_ms.get(rows)
            self._decode_ms[rows] = ms if old is None else old + DECODE_WEIGHT * (ms - old)

    def observe_step(self, planned_ms: float, ms: float) -> None:
        """A step planned (``planned_ms``) to carry prompt tokens beside decode rows took
        ``ms``, all of it: what its streams waited between two tokens."""
        if planned_ms > 0:
            with self._lock:
                self._overruns.append(ms / planned_ms)

    def snapshot(self) -> dict[str, Any]:
        """What was observed, as plain JSON data (``restore`` takes it back)."""
        with self._lock:
            return {"prefills": [list(x) for x in self._prefills],
                    "mixed": [list(x) for x in self._mixed],
                    "decode_ms": {str(rows): ms for rows, ms in self._decode_ms.items()},
                    "overruns": list(self._overruns)}

    def restore(self, data: Mapping[str, Any]) -> None:
        """Take observations from ``snapshot``'s data (another start's) as if seen here."""
        with self._lock:
            self._prefills.extend((int(n), float(ms)) for n, ms in data["prefills"])
            self._mixed.extend((int(n), float(ms)) for n, ms in data["mixed"])
            self._decode_ms.update({int(r): float(ms) for r, ms in data["decode_ms"].items()})
            self._overruns.extend(float(x) for x in data["overruns"])

    def margin(self) -> float:
        """Actual over planned time of recent planned steps, at ``MARGIN_QUANTILE``,
        within ``MARGIN_BOUNDS``; 1 before ``MARGIN_MIN_SAMPLES`` were seen."""
        with self._lock:
            ratios = sorted(self._overruns)
        if len(ratios) < MARGIN_MIN_SAMPLES:
            return 1.0
        at = ratios[min(int(MARGIN_QUANTILE * len(ratios)), len(ratios) - 1)]
        low, high = MARGIN_BOUNDS
        return min(max(at, low), high)

    def step_ms(self, decode_rows: int, cost: int, mixed: bool) -> float | None:
        """What a step of ``decode_rows`` decode rows and prompt tokens counting ``cost``
        (``cost_tokens``) should take by the fitted lines; None before estimates exist."""
        decode = self.decode_ms(decode_rows)
        line = self.step_line(decode_rows, mixed) if cost else (0.0, 0.0)
        if line is None or decode is None:
            return None
        return decode + line[0] + line[1] * cost

    def prefill_line(self) -> tuple[float, float] | None:
        """(fixed ms, ms per token) of a prefill pass, or None before any was seen."""
        with self._lock:
            samples = list(self._prefills)
        return _fit(samples)

    def mixed_line(self) -> tuple[float, float] | None:
        """(extra ms, ms per prompt token) of a mixed pass beyond its decode rows' own
        pass, or None before any was seen."""
        with self._lock:
            samples = list(self._mixed)
        return _fit(samples)

    def step_line(self, decode_rows: int, mixed: bool) -> tuple[float, float] | None:
        """(overhead ms, ms per prompt token) that prompt tokens add to a step with
        ``decode_rows`` decode rows: with ``mixed`` and rows, the mixed line (the
        prefill line until a mixed pass was seen); else the prefill pass's line."""
        line = self.mixed_line() if mixed and decode_rows else None
        return line or self.prefill_line()

    def prefill_ms(self, tokens: int) -> float | None:
        line = self.prefill_line()
        return None if line is None else line[0] + line[1] * tokens

    def decode_ms(self, rows: int) -> float | None:
        """A decode pass at batch ``rows``: 0 for none, None before any was seen."""
        if rows == 0:
            return 0.0
        with self._lock:
            known = dict(self._decode_ms)
        if not known:
            return None
        if rows in known:
            return known[rows]
        below = [b for b in known if b < rows]
        above = [b for b in known if b > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (rows - lo) / (hi - lo)
        nearest = max(below) if below else min(above)
        return known[nearest] * max(1.0, rows / nearest) ** 0.5  # grows sublinearly

    def decode_ms_low(self, rows: int) -> float | None:
        """``decode_ms``, but below the smallest batch seen a lower estimate, shrinking as
        it grows (sublinearly): where only full batches ran, a smaller one is not assumed
        as slow as they are. For a reference that must not be overestimated (the band
        yielding's: what a higher band's rows cost alone); None before any was seen."""
        with self._lock:
            smallest = min(self._decode_ms, default=None)
        estimate = self.decode_ms(rows)
        if estimate is None or smallest is None or rows >= smallest:
            return estimate
        return estimate * (rows / smallest) ** 0.5

    def prefill_tokens_within(
        self, target_ms: float, decode_rows: int, mixed: bool = False
    ) -> int | None:
        """Prompt tokens a step with ``decode_rows`` decode rows (in the same pass with
        ``mixed``) may carry within ``target_ms`` (0 if the decode alone fills it), or
        None before estimates exist."""
        line, decode = self.step_line(decode_rows, mixed), self.decode_ms(decode_rows)
        if line is None or decode is None:
            return None
        overhead, per_token = line
        return max(int((target_ms - decode - overhead) / per_token), 0)


def cost_tokens(n: int, start: int) -> int:
    """A chunk of ``n`` tokens from position ``start``, in tokens of no prefix."""
    return round(n * (1 + start / PREFIX_POSITIONS))


def tokens_within(cost: int, start: int) -> int:
    """The most tokens from position ``start`` that ``cost_tokens`` counts as ``cost``."""
    return round(cost / (1 + start / PREFIX_POSITIONS))


def _fit(samples: list[tuple[int, float]]) -> tuple[float, float] | None:
    """A least-squares line (intercept >= 0, slope > 0) through (tokens, ms)."""
    if not samples:
        return None
    xs = [float(n) for n, _ in samples]
    ys = [ms for _, ms in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:  # one size seen: no way to tell the overhead apart
        return 0.0, max(mean_y / mean_x, 1e-6)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    slope = max(slope, 1e-6)
    return max(mean_y - slope * mean_x, 0.0), slope


def timed(run: Callable[[list[_T]], _R], items: list[_T],
          observe: Callable[[int, float], None], size: int) -> _R:
    """``run(items)``, and ``observe(size, its milliseconds)``."""
    started = time.perf_counter()
    result = run(items)
    observe(size, (time.perf_counter() - started) * 1000)
    return result


def calibrate(
    runner: Runner, costs: StepCosts, *, num_blocks: int, positions: int, max_batch: int,
    mixed: bool = False,
) -> None:
    """Time a few forward passes, so that a step-time budget has estimates from the
    first step: a warm-up pass (not counted), prefills of two sizes and decodes at
    batch 1 and at ``max_batch``, twice each; with ``mixed``, mixed passes of the two
    prefill sizes with ``max_batch`` decode rows too, whose spread around the line
    fitted through them is the margin's first observations. The dummy sequences share
    one table of every block: run only while no sequence holds any (at start-up), their
    writes land where nobody reads.

    Where a start keeps its results (``start_cache``), a calibration saved by a start
    like this one is reused if a check agrees: the warm-up, then two decode passes at
    ``max_batch``, the faster within ``REUSE_TOLERANCE`` of the saved estimate (the
    check's passes are observed too). Else, or with none saved, it calibrates afresh
    and saves the result. Either way the costs go on adapting from every step."""
    detail = {"positions": positions, "max_batch": max_batch, "mixed": mixed}
    saved = start_cache.load("calibration", detail)
    if saved is not None:
        with phase("calibration_check"):
            if _reuse(runner, costs, saved, num_blocks=num_blocks, positions=positions,
                      max_batch=max_batch):
                return
    with phase("calibration"):
        _calibrate(runner, costs, num_blocks=num_blocks, positions=positions,
                   max_batch=max_batch, mixed=mixed)
    start_cache.save("calibration", detail, costs.snapshot())


def _reuse(runner: Runner, costs: StepCosts, saved: Mapping[str, Any], *, num_blocks: int,
           positions: int, max_batch: int) -> bool:
    """Check ``saved`` against two decode passes at ``max_batch``; restore it if it holds."""
    try:
        expected = float(saved["decode_ms"][str(max_batch)])
        restored = StepCosts()
        restored.restore(saved)
    except (KeyError, TypeError, ValueError):
        return False
    dummy = _dummies(num_blocks)
    small = min(32, positions // 4)
    runner.prefill([Chunk(dummy(small), 0, small)])  # warm-up
    seen: list[float] = []
    for _ in range(2):
        timed(runner.decode, [dummy(small, 1) for _ in range(max_batch)],
              lambda _rows, ms: seen.append(ms), max_batch)
    if not expected / REUSE_TOLERANCE <= min(seen) <= expected * REUSE_TOLERANCE:
        return False
    costs.restore(saved)
    for ms in seen:
        costs.observe_decode(max_batch, ms)
    return True


def _dummies(num_blocks: int) -> Callable[..., Sequence]:
    """``dummy(n, generated=0)``: a sequence of ``n`` prompt tokens on one shared table of
    every block (its writes land where nobody reads)."""
    table = BlockTable("calibration", list(range(num_blocks)), is_released=True)

    def dummy(n: int, generated: int = 0) -> Sequence:
        seq = Sequence(GenerationRequest("calibration", "", 1), [0] * n,
                       None, None, None)  # type: ignore[arg-type]  # no text: never recorded
        seq.block_table, seq.generated_ids = table, [0] * generated
        return seq

    return dummy


def _calibrate(
    runner: Runner, costs: StepCosts, *, num_blocks: int, positions: int, max_batch: int,
    mixed: bool,
) -> None:
    dummy = _dummies(num_blocks)
    small, large = min(32, positions // 4), min(256, positions // 2)
    runner.prefill([Chunk(dummy(small), 0, small)])  # warm-up
    for n in (small, large, small, large):
        timed(runner.prefill, [Chunk(dummy(n), 0, n)], costs.observe_prefill, n)
    for rows in (1, max_batch, 1, max_batch):
        timed(runner.decode, [dummy(small, 1) for _ in range(rows)], costs.observe_decode, rows)
    passes = []
    for n in (small, large, small, large) if mixed else ():
        started = time.perf_counter()
        runner.mixed([Chunk(dummy(n), 0, n)], [dummy(small, 1) for _ in range(max_batch)])
        passes.append((n, (time.perf_counter() - started) * 1000))
        costs.observe_mixed(n, max_batch, passes[-1][1])
    for n, ms in passes:  # the margin starts from how far the same passes spread
        planned = costs.step_ms(max_batch, n, mixed)
        if planned is not None:
            costs.observe_step(planned, ms)

"""What a step's forward passes cost, measured, for the step-time budget.

Theory of operation. A step runs at most two forward passes: one prefill pass
over the prompt chunks chosen for it, and one decode pass over every other
running sequence. Their times are observed after every step (and once at start
up, by ``Engine.calibrate``) and fitted:

* a prefill pass of ``n`` tokens costs ``fixed + per_token * n`` milliseconds, a
  least-squares line through the most recent passes (its fixed part is the pass
  overhead: the per-layer Python and kernel launches a pass pays at any size);
* a decode pass at batch ``b`` costs what passes at that batch size cost lately
  (a moving average per size), interpolated between the sizes seen.

``prefill_tokens_within(target_ms, decode_rows)`` then says how many prompt
tokens a step may carry so that it stays within ``target_ms`` with its decode
pass. Pure Python, no torch; the numbers are only as good as the machine is
steady, so the fit keeps adapting. Thread-safe: the stepping thread observes while
another may estimate (``Engine.estimate_ttft_ms``).
"""

from __future__ import annotations

import threading
from collections import deque

WINDOW = 64  # prefill passes in the fit: about a minute of bursts, forgetting older load
DECODE_WEIGHT = 0.2  # each new decode time's weight in its batch size's moving average


class StepCosts:
    def __init__(self) -> None:
        self._prefills: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._decode_ms: dict[int, float] = {}
        self._lock = threading.Lock()  # guards both

    def observe_prefill(self, tokens: int, ms: float) -> None:
        with self._lock:
            self._prefills.append((tokens, ms))

    def observe_decode(self, rows: int, ms: float) -> None:
        with self._lock:
            old = self._decode_ms.get(rows)
            self._decode_ms[rows] = ms if old is None else old + DECODE_WEIGHT * (ms - old)

    def prefill_line(self) -> tuple[float, float] | None:
        """(fixed ms, ms per token) of a prefill pass, or None before any was seen."""
        with self._lock:
            samples = list(self._prefills)
        if not samples:
            return None
        xs = [float(n) for n, _ in samples]
        ys = [ms for _, ms in samples]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mean_x) ** 2 for x in xs)
        if var == 0:  # one size seen: no way to tell the overhead apart
            return 0.0, mean_y / mean_x
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
        slope = max(slope, 1e-6)
        return max(mean_y - slope * mean_x, 0.0), slope

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

    def prefill_tokens_within(self, target_ms: float, decode_rows: int) -> int | None:
        """Prompt tokens a step with ``decode_rows`` decode rows may carry within
        ``target_ms`` (0 if the decode alone fills it), or None before estimates exist."""
        line, decode = self.prefill_line(), self.decode_ms(decode_rows)
        if line is None or decode is None:
            return None
        fixed, per_token = line
        return max(int((target_ms - decode - fixed) / per_token), 0)

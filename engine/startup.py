"""What a start spends its time on: named phases, timed where they happen.

``load_engine`` opens a ``recording()`` for the thread that builds the engine; the code
of each phase (``model.load_model``, ``kv_cache``, ``costs``) wraps its work in
``phase(name)``, which adds the seconds to the recording of the current thread, and is
a no-op where nobody records (a test building an engine, a tool). The result, a plain
``{name: seconds}`` in the order the phases ran, is ``Engine.start_phases_s``, which the
app shows in ``/stats`` (``start_phases_s``) and ``tools.startbench`` reads.

Phases (seconds, where they ran): ``import_torch``, ``import_transformers``, ``tokenizer``,
``weights`` (reading the model: from the converted copy or the folder), ``gguf_convert``
(dequantizing the embedded GGUF file, a first start only), ``save_converted`` (writing
the copy that the next start reads), ``to_device``, ``engine`` (the Engine's own set-up:
the prompt encoder's copy of the tokenizer, the scheduler), ``cache`` (allocating the KV
cache), ``calibration`` (the step-cost passes, with a step-time target) or
``calibration_check`` (the check of a saved one, ``start_cache``); the app adds
``gc_freeze`` and ``process_until_load`` (``app/runtime/loading.py``). Pure stdlib.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


class StartPhases:
    """Seconds per named phase, in the order they first ran (a repeated name adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def rounded(self) -> dict[str, float]:
        return {name: round(s, 4) for name, s in self.seconds.items()}


@contextmanager
def recording() -> Iterator[StartPhases]:
    """Record the phases this thread runs until the block ends (nested: the inner one)."""
    outer = getattr(_local, "phases", None)
    _local.phases = phases = StartPhases()
    try:
        yield phases
    finally:
        _local.phases = outer


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block into this thread's recording, if one is open. A phase inside
    another counts for itself alone: the outer one gets its time without the inner's,
    so that the phases add up to the whole."""
    phases: StartPhases | None = getattr(_local, "phases", None)
    if phases is None:
        yield
        return
    inner: list[float] = getattr(_local, "inner", [])
    _local.inner = inner
    inner.append(0.0)  # the time of phases nested in this one
    started = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - started
        phases.add(name, elapsed - inner.pop())
        if inner:
            inner[-1] += elapsed

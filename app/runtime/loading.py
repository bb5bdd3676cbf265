"""The engine as the server uses it, and how it is built.

``Runtime`` builds the engine through a ``MakeEngine`` (tests pass their own; the server
``load_engine_from_settings``) in a worker thread, by ``build_and_freeze``. The app knows
the engine only as ``ServingEngine`` (the hub's ``StepEngine`` plus ``statistics()`` and
the tokenizer's work) and imports nothing below the engine package root.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import engine
import streams

from ..settings import SettingsError, env_name
from ..settings_engine import EngineSettings


class ServingEngine(streams.StepEngine, Protocol):
    """The engine as the app uses it; ``engine.Engine`` satisfies it.

    ``tokenize`` is thread-safe, blocks, and uses no tokenizer the step uses: the app
    runs it in a worker thread and submits the ids in ``prompt_token_ids``.
    """

    # Prompt and new tokens together, at most (``Engine.max_positions``).
    max_positions: int

    def statistics(self) -> engine.EngineStatistics: ...
    def tokenize(self, prompt: str) -> list[int]: ...
    def tokenize_if_free(self, prompt: str) -> list[int] | None: ...
    def compile_constraint(self, constraint: engine.Constraint, namespace: bytes = b"",
                           owner: Hashable = None) -> None: ...
    def constraint_cached(self, constraint: engine.Constraint, namespace: bytes = b"") -> bool:
        ...
    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, list[int]]: ...
    def chat_template_uses(self, name: str) -> bool: ...


# Builds the engine from the engine's settings only (``EngineSettings``: the server's
# ``Settings`` is one, and its other fields are no business of the engine's).
MakeEngine = Callable[[EngineSettings], ServingEngine]
# Makes the hub over the built engine: ``streams.Hub`` in the service; the lab's ``naive``
# device makes one that steps its own way (``tools/lab/naive.py``).
MakeHub = Callable[[ServingEngine, streams.HubSettings], streams.Hub]
# The oldest generation's threshold while the engine is built: full collections that many
# young collections apart, i.e. none during a build.
NO_FULL_COLLECTION = 1_000_000


def load_engine_from_settings(settings: EngineSettings, **engine_options: Any) -> ServingEngine:
    """The production ``make_engine``: load the model (imports torch, blocks for seconds).
    ``engine_options`` go to the Engine as well: the lab's seam for its devices (e.g. the
    reservation admission, ``tools/lab/reservation.py``).

    Raises:
        SettingsError: naming ``STREAMSCOPE_DTYPE`` when the device cannot run it.
    """
    try:
        return _load(settings, engine_options)
    except engine.PrecisionError as exc:
        raise SettingsError([f"{env_name('dtype')}={settings.dtype}: {exc}"]) from None


def _load(settings: EngineSettings, engine_options: dict[str, Any]) -> ServingEngine:
    return engine.load_engine(
        settings.model,
        settings.device,
        start_cache=settings.start_cache,
        max_batch=settings.max_batch,
        max_prefill_tokens=settings.max_prefill_tokens,
        max_step_ms=settings.max_step_ms,
        num_blocks=settings.cache_blocks,
        block_size=settings.block_size,
        cache_memory=settings.cache_memory,
        prefix_cache=settings.prefix_cache,
        precision=settings.dtype,
        **engine_options,
    )


def build_and_freeze(make_engine: MakeEngine, settings: EngineSettings) -> ServingEngine:
    """In a worker thread: build the engine, then take every object alive then out of the
    cyclic garbage collector's reach (``gc.freeze``). With the embedded model loaded a
    full collection walks about 400,000 objects (mostly the functions and tuples of
    transformers' modules), which held the event loop for 0.2-0.5 s each time it ran;
    after the freeze, collections walk only what the serving allocates.

    During the build the collector runs no full collection (``gc.set_threshold``; the
    young generations are collected as usual): the imports and the load made it run
    six, over the growing heap of module objects, 0.7-1.2 s of a start on the 2-core
    machine. Nor is one run before the freeze (0.2-0.4 s): the cyclic garbage of the
    load, about 350 objects and no measurable memory with the embedded model, stays
    frozen. Only after a GGUF conversion (whose garbage was not measured small), or an
    engine that says nothing of its start, is a full collection run first, as before.
    """
    waited = process_age_s()  # the interpreter, the app's and hypercorn's imports, the lifespan
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], NO_FULL_COLLECTION)
    try:
        built = make_engine(settings)
    finally:
        gc.set_threshold(*thresholds)
    started = time.perf_counter()
    phases = getattr(built, "start_phases_s", None)  # engine.Engine's; a test's may lack it
    if not isinstance(phases, dict) or "gguf_convert" in phases:
        gc.collect()  # garbage left by the load: frozen, it would stay forever
    gc.freeze()
    if isinstance(phases, dict):
        phases["gc_freeze"] = round(time.perf_counter() - started, 4)
        if waited is not None:
            phases["process_until_load"] = round(waited, 4)
    return built


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: its start in clock ticks since boot, in
    ``/proc/self/stat``, against ``CLOCK_BOOTTIME``); None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, counted after the command's ")"
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None

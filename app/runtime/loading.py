"""The engine as the server uses it, and how it is built.

``Runtime`` builds the engine through a ``MakeEngine`` (tests pass their own; the server
``load_engine_from_settings``) in a worker thread, by ``build_and_freeze``. The app knows
the engine only as ``ServingEngine`` (the hub's ``StepEngine`` plus ``statistics()`` and
the tokenizer's work) and imports nothing below the engine package root.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import engine
import streams

from ..settings import Settings


class ServingEngine(streams.StepEngine, Protocol):
    """The engine as the app uses it; ``engine.Engine`` satisfies it.

    ``tokenize`` is thread-safe, blocks, and uses no tokenizer the step uses: the app
    runs it in a worker thread and submits the ids in ``prompt_token_ids``.
    """

    def statistics(self) -> engine.EngineStatistics: ...
    def tokenize(self, prompt: str) -> list[int]: ...
    def tokenize_if_free(self, prompt: str) -> list[int] | None: ...
    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
    ) -> tuple[str, list[int]]: ...


MakeEngine = Callable[[Settings], ServingEngine]


def load_engine_from_settings(settings: Settings, **engine_options: Any) -> ServingEngine:
    """The production ``make_engine``: load the model (imports torch, blocks for seconds).
    ``engine_options`` go to the Engine as well: the lab's seam for its devices (e.g. the
    reservation admission, ``tools/lab/reservation.py``)."""
    return engine.load_engine(
        settings.model,
        settings.device,
        max_batch=settings.max_batch,
        max_prefill_tokens=settings.max_prefill_tokens,
        max_step_ms=settings.max_step_ms,
        num_blocks=settings.cache_blocks,
        block_size=settings.block_size,
        cache_memory=settings.cache_memory,
        **engine_options,
    )


def build_and_freeze(make_engine: MakeEngine, settings: Settings) -> ServingEngine:
    """In a worker thread: build the engine, then take every object alive then out of the
    cyclic garbage collector's reach (``gc.freeze``). With the embedded model loaded a
    full collection walks about 400,000 objects (mostly the functions and tuples of
    transformers' modules), which held the event loop for 0.2-0.5 s each time it ran;
    after the freeze, collections walk only what the serving allocates."""
    built = make_engine(settings)
    gc.collect()  # garbage left by the load: frozen, it would stay forever
    gc.freeze()
    return built

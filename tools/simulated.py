"""A simulated accelerator: an engine whose forward pass costs a fixed wall time.

Why: on this CPU machine the tiny model's arithmetic is cheap and the embedded model's is
slow, so neither shows what the serving path (scheduler, block manager, detokenizer, hub,
HTTP) costs beside an accelerator that finishes a batch of up to 256 rows in a few
milliseconds. ``SimulatedRunner`` is an ``engine.engine.Runner`` whose forward pass
sleeps a fixed time (``time.sleep`` releases the GIL, as a GPU kernel does) whatever the
batch, then samples through the real ``engine/sampling.py`` code; everything but the
model's arithmetic is the real engine. Its logits are a one-hot row per sequence at a
token chosen by a hash of (the row's last token, its position), over the tokenizer's
vocabulary without its end-of-sequence ids: deterministic, cheap, and never an end.

The model source is the tiny model's loaded object (tokenizer, eos ids), with a longer
context (``SIM_MAX_CONTEXT``): the runner holds no KV tensors, so a position costs only
its block's bookkeeping.

``hypercorn -k trio 'tools.simulated:build_app()'`` serves the service with this engine
(``create_app(settings, make_engine=...)``, as ``tools/lab/_asgi.py`` builds the lab's
app); hypercorn evaluates what follows the colon in the module, so the app is built by
that call and importing this module for the runner alone (``tools.servicebench`` does,
in process) builds no app and touches no environment variable. Its own setting,
``STREAMSCOPE_SIM_STEP_MS`` (default ``DEFAULT_STEP_MS``), is read and taken out of the
environment before ``app`` is imported, since importing ``app`` reads the service's
settings, which refuse every ``STREAMSCOPE_`` name they do not know.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from engine import sampling
from engine.engine import Engine
from engine.logprobs import Outcome

if TYPE_CHECKING:
    from app.factory import StreamscopeApp
    from app.settings import Settings
    from engine.model import LoadedModel
    from engine.sequence import Chunk, Sequence
    from engine.types import SamplingParams

DEFAULT_STEP_MS = 5.0
STEP_MS_VARIABLE = "STREAMSCOPE_SIM_STEP_MS"
# Positions a simulated sequence may reach: room for thousands of tokens after a prompt,
# where the tiny model's own 512 would cap a run at about 500.
SIM_MAX_CONTEXT = 4096
_HASH_PRIME = 1_000_003  # mixes (token, position) into an index over the vocabulary


@dataclass(frozen=True)
class SimulatedSource:
    """The ``engine.engine.ModelSource`` of a simulated engine: a real tokenizer."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_context: int


def simulated_source(loaded: LoadedModel, max_context: int = SIM_MAX_CONTEXT) -> SimulatedSource:
    return SimulatedSource(loaded.tokenizer, loaded.eos_token_ids,
                           max(loaded.max_context, max_context))


class SimulatedRunner:
    """A ``Runner`` whose every forward pass takes ``step_ms`` of wall time (see the
    module docstring). ``passes`` and ``pass_s`` count its passes and their time."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], step_ms: float) -> None:
        self.vocab_size = vocab_size
        self.step_s = step_ms / 1000
        self._choices = torch.tensor([t for t in range(vocab_size) if t not in eos_token_ids])
        self.device = torch.device("cpu")
        self.passes = 0
        self.pass_s = 0.0

    def new_generator(self, params: SamplingParams) -> torch.Generator | None:
        return sampling.make_generator(params, self.device)

    def advance_generator(self, generator: object | None, generated_ids: list[int]) -> None:
        if isinstance(generator, torch.Generator):
            sampling.advance(generator, self.vocab_size, len(generated_ids))

    def prefill(self, chunks: list[Chunk]) -> list[Outcome | None]:
        return self.mixed(chunks, [])[0]

    def decode(self, seqs: list[Sequence]) -> list[Outcome]:
        return self.mixed([], seqs)[1]

    def mixed(
        self, chunks: list[Chunk], seqs: list[Sequence]
    ) -> tuple[list[Outcome | None], list[Outcome]]:
        """One simulated pass over the chunks and the decode rows; a token for each row
        that samples (a prompt's last chunk, every decode row), as ``ModelRunner``."""
        done = [c for c in chunks if c.samples]
        rows = [(c.ids[-1], c.end - 1) for c in done] + [(s.last_token_id, s.num_cached)
                                                          for s in seqs]
        logits = self._forward(rows)
        sampled = iter(self._sample([c.seq for c in done] + list(seqs), logits))
        prefilled = [next(sampled) if c.samples else None for c in chunks]
        return prefilled, [next(sampled) for _ in seqs]

    def _forward(self, rows: list[tuple[int, int]]) -> torch.Tensor:
        """(rows, vocab) one-hot logits, the pass padded with a sleep to ``step_s``."""
        started = time.perf_counter()
        logits = torch.zeros(len(rows), self.vocab_size)
        if rows:
            keys = torch.tensor([token * _HASH_PRIME + position for token, position in rows])
            picks = self._choices[keys % len(self._choices)]
            logits.scatter_(1, picks.unsqueeze(1), 1.0)
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        self.passes += 1
        self.pass_s += time.perf_counter() - started
        return logits

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Outcome]:
        """Each row's next token, or the exception sampling it raised: the same calls
        into ``engine.sampling`` as ``ModelRunner._sample``."""
        if not seqs:
            return []
        return sampling.sample(logits, [
            (seq.request.sampling,
             seq.generator if isinstance(seq.generator, torch.Generator) else None)
            for seq in seqs])


def simulated_engine(loaded: LoadedModel, *, step_ms: float, max_batch: int,
                     block_size: int = 16, num_blocks: int | None = None,
                     **engine_options: Any) -> Engine:
    """An ``Engine`` over ``SimulatedRunner``: every block a full batch of
    ``SIM_MAX_CONTEXT`` positions needs unless ``num_blocks`` says otherwise (the blocks
    hold nothing)."""
    source = simulated_source(loaded)
    runner = SimulatedRunner(loaded.model.config.vocab_size, loaded.eos_token_ids, step_ms)
    blocks = num_blocks or max_batch * math.ceil(source.max_context / block_size)
    return Engine(source, runner=runner, max_batch=max_batch, num_blocks=blocks,
                  block_size=block_size, **engine_options)


def make_engine(settings: Settings, step_ms: float = DEFAULT_STEP_MS) -> Engine:
    """``MakeEngine`` for ``create_app``: the settings' model as the source, its batch,
    block and prefill settings; ``step_ms`` per forward pass."""
    from engine.model import load_model

    return simulated_engine(
        load_model(settings.model, "cpu"), step_ms=step_ms, max_batch=settings.max_batch,
        block_size=settings.block_size, num_blocks=settings.cache_blocks,
        max_prefill_tokens=settings.max_prefill_tokens, max_step_ms=settings.max_step_ms,
        prefix_cache=settings.prefix_cache,
    )


def build_app() -> StreamscopeApp:
    """The service with a simulated engine, for hypercorn (see the module docstring)."""
    step_ms = float(os.environ.pop(STEP_MS_VARIABLE, "") or DEFAULT_STEP_MS)
    from app.factory import create_app

    return create_app(make_engine=partial(make_engine, step_ms=step_ms), drain_on_sigterm=True)


"""The exact mode: a runner that prefills each prompt in a pass of its own.

The engine hands a step's prompt chunks to one ``Runner.prefill`` call, which the
product's runner packs into one forward pass (issue 10: a step pays the model's
per-pass cost once). Before that, every prompt had a pass of its own, exactly as a
prompt alone; ``tools.bench burst``'s ``serial`` setting still measures that, by
wrapping the product's runner in ``SerialPrefill`` and turning the mixed step off
(a mixed pass packs by nature). It is a benchmark's device, so it lives here and not
among the engine's options.

What differs from the engine's own serial branch of before: the step costs see the
step's passes as one prefill observation of their tokens (they only matter with a
step-time target, which the ``serial`` setting does not set), and if one prompt's pass
raises, the engine retries the step's chunks one at a time, passing the ones before it
again (a failure the benchmark never meets).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.logprobs import Outcome
from engine.model_side import Runner
from engine.sequence import Chunk, Sequence
from engine.types import SamplingParams


class SerialPrefill:
    """A ``Runner`` whose ``prefill`` is one pass per chunk; the rest is ``inner``'s."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner

    def prefill(self, chunks: list[Chunk]) -> list[Outcome | None]:
        return [self.inner.prefill([chunk])[0] for chunk in chunks]

    def decode(self, seqs: list[Sequence]) -> Seq[Outcome]:
        return self.inner.decode(seqs)

    def mixed(
        self, chunks: list[Chunk], seqs: list[Sequence]
    ) -> tuple[Seq[Outcome | None], Seq[Outcome]]:
        return self.inner.mixed(chunks, seqs)

    def new_generator(self, params: SamplingParams) -> object | None:
        return self.inner.new_generator(params)

    def advance_generator(self, generator: object | None, generated_ids: list[int]) -> None:
        self.inner.advance_generator(generator, generated_ids)

"""A step's forward passes, and what a failed one ends.

The engine's step plans its passes (``Scheduler.schedule``); ``StepPasses`` runs them
through the runner, times them into the step costs (``costs.StepCosts``: what a
step-time budget and the TTFT estimate are planned by) and turns their outcomes into
events through the scheduler, which owns every finish. A failure is contained to what
it concerns: a failed packed prefill is retried one prompt at a time, so it ends only
the prompts that fail alone; a failed mixed pass runs again as a prefill and a decode
(each with its own containment); a failed decode pass finishes the sequences in it.
Either way the step goes on. The stepping thread only; no torch.
"""

from __future__ import annotations

import time

from .costs import cost_tokens, timed
from .model_side import Runner
from .scheduler import Scheduler
from .sequence import Chunk, Sequence
from .types import EngineEvent, FinishReason


class StepPasses:
    """The passes of every step of one engine, over its runner and scheduler."""

    def __init__(self, runner: Runner, scheduler: Scheduler) -> None:
        self._runner = runner
        self._scheduler = scheduler
        self.num_mixed = 0  # mixed passes that succeeded: a step's prefill and decode in one

    def prefill(self, chunks: list[Chunk]) -> list[EngineEvent]:
        """One packed prefill pass. If a packed pass fails, each chunk is retried alone,
        so a failure ends only its own prompt."""
        if not chunks:
            return []
        tokens = sum(cost_tokens(c.end - c.start, c.start) for c in chunks)
        try:
            observe = self._scheduler.costs.observe_prefill
            outcomes = timed(self._runner.prefill, chunks, observe, tokens)
        except Exception as exc:
            if len(chunks) > 1:
                return [e for chunk in chunks for e in self.prefill([chunk])]
            error = f"prefill failed: {exc}"
            return [self._scheduler.finish(chunks[0].seq, FinishReason.ERROR, error=error)]
        record = self._scheduler.record_chunk
        return [e for c, out in zip(chunks, outcomes, strict=True) for e in record(c, out)]

    def mixed(self, chunks: list[Chunk], seqs: list[Sequence]) -> list[EngineEvent]:
        """One forward pass for both; the prefills' events, then the decodes'. If it
        fails, the two run apart as ``prefill`` and ``decode`` (each with its own
        failure handling), so a failure ends no more than those would."""
        tokens = sum(cost_tokens(c.end - c.start, c.start) for c in chunks)
        started = time.perf_counter()
        try:
            prefilled, decoded = self._runner.mixed(chunks, seqs)
        except Exception:
            return self.prefill(chunks) + self.decode(seqs)
        ms = (time.perf_counter() - started) * 1000
        self._scheduler.costs.observe_mixed(tokens, len(seqs), ms)
        self.num_mixed += 1
        record_chunk, record_token = self._scheduler.record_chunk, self._scheduler.record_token
        return [e for c, out in zip(chunks, prefilled, strict=True) for e in record_chunk(c, out)
                ] + [e for s, out in zip(seqs, decoded, strict=True) for e in record_token(s, out)]

    def decode(self, seqs: list[Sequence]) -> list[EngineEvent]:
        """One decode pass; if it fails, every sequence in it ends."""
        if not seqs:
            return []
        try:
            observe = self._scheduler.costs.observe_decode
            outcomes = timed(self._runner.decode, seqs, observe, len(seqs))
        except Exception as exc:
            error = f"decode failed: {exc}"
            return [self._scheduler.finish(s, FinishReason.ERROR, error=error) for s in seqs]
        record = self._scheduler.record_token
        return [e for s, out in zip(seqs, outcomes, strict=True) for e in record(s, out)]

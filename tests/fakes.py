"""Deterministic fakes for the hub's tests: a scripted engine and a fixed-cost step.

``ScriptedEngine`` satisfies ``streams.StepEngine`` with the real engine's semantics:
submit, cancel, pause and resume only record wishes, applied at the start of the next
step; a step admits and prefills waiting requests (up to ``batch_limit`` running and
while blocks last), then decodes one token for every running, unpaused sequence that
was not prefilled in this step. Request ``r`` generates ``r.max_new_tokens`` tokens and
then finishes with LENGTH. It records what happened so tests can assert on it, and
raises ``DoubleRelease`` on a second release and ``StepReentered`` on re-entry.
``tests/test_engine_conformance.py`` runs the same scenarios on it and on the real
engine and checks that each step's events and ``has_work()`` agree. One difference is
kept on purpose: it hands each prefill's events to ``on_prefill`` in a call of their
own (``before_prefill`` runs between them), where the engine prefills a step's prompts
in one pass and hands their first tokens over in one call; the hub handles both. As
the engine's mixed step (``mixed_step``, the default) does, a step that prefills hands
its decodes' events to ``on_prefill`` too (one pass made them all).
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from engine import (
    DoubleRelease,
    DuplicateRequestId,
    EmptyPrompt,
    EngineEvent,
    EngineStatistics,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidMaxNewTokens,
    PromptTooLong,
    StepReentered,
    TokenEvent,
)
from streams import Hub, HubSettings, TokenStream

STEP_S = 1 / 64  # a binary fraction, so sums of step costs are exact in virtual time
HANG_GUARD_S = 100.0  # (virtual) seconds; the longest test here needs about 4

OnPrefill = Callable[[list[EngineEvent]], None]
RunStep = Callable[[Callable[[], list[EngineEvent]]], Awaitable[list[EngineEvent]]]


class ScriptedFailure(RuntimeError):
    """What ScriptedEngine.step raises at ``fail_at_step``."""


@dataclass
class _Sequence:
    request: GenerationRequest
    prompt_tokens: int
    blocks: int
    generated: int = 0
    is_paused: bool = False


class ScriptedEngine:
    def __init__(
        self,
        *,
        batch_limit: int = 8,
        blocks_total: int = 256,
        block_size: int = 16,
        fail_at_step: int | None = None,
        fail_requests: frozenset[str] = frozenset(),
        before_prefill: Callable[[str], None] | None = None,
        mixed_step: bool = True,
    ) -> None:
        self.batch_limit = batch_limit
        self.mixed_step = mixed_step  # a step that prefills hands its decodes early too
        self.blocks_total = self.blocks_free = blocks_total
        self.block_size = block_size
        self.fail_at_step = fail_at_step  # step() raises ScriptedFailure at this step
        self.fail_requests = fail_requests  # these fail (FinishReason.ERROR) at their 1st decode
        self.before_prefill = before_prefill  # called in the stepping thread, per prefill
        self.submitted: list[str] = []
        self.cancelled: list[str] = []  # cancel() calls, applied or not
        self.admitted: list[str] = []
        self.releases: Counter[str] = Counter()
        self.log: list[tuple[int, str, str]] = []  # (step, pause|resume|cancel, id) applied
        self.steps = 0
        self._lock = threading.Lock()  # guards the inbox and the ids in use
        self._inbox: list[tuple[str, GenerationRequest | str]] = []
        self._live: set[str] = set()  # submitted and not yet finished
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[str, _Sequence] = {}
        self._in_step = False

    # -- the StepEngine interface ------------------------------------------------

    def submit(self, request: GenerationRequest, resume_from: Sequence[int] = ()) -> int:
        if resume_from:
            raise NotImplementedError("the fake engine does not continue streams")
        prompt_tokens = len(request.prompt.split())
        if prompt_tokens == 0:
            raise EmptyPrompt("the prompt has no tokens")
        if request.max_new_tokens < 1:
            raise InvalidMaxNewTokens(f"max_new_tokens={request.max_new_tokens}")
        if self._blocks_for(prompt_tokens, request) > self.blocks_total:
            raise PromptTooLong("the request cannot fit in the cache")
        with self._lock:
            if request.request_id in self._live:
                raise DuplicateRequestId(request.request_id)
            self._live.add(request.request_id)
            self.submitted.append(request.request_id)
            self._inbox.append(("submit", request))
        return prompt_tokens

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled.append(request_id)
            self._inbox.append(("cancel", request_id))

    def pause(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("pause", request_id))

    def resume(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("resume", request_id))

    def has_work(self) -> bool:
        # As the engine: a waiting request counts only if it could be admitted now.
        with self._lock:
            if self._inbox:
                return True
        head = self._waiting[0] if self._waiting else None
        can_admit = (
            head is not None
            and len(self._running) < self.batch_limit
            and head.blocks <= self.blocks_free
        )
        return can_admit or any(not seq.is_paused for seq in self._running.values())

    def estimate_ttft_ms(self, prompt_tokens: int, prompt_ids: Sequence[int] = (),
                         cache_namespace: bytes = b"", priority: int = 0) -> float | None:
        return None  # nothing measured: a deadline never refuses here

    def step(self, on_prefill: OnPrefill | None = None) -> list[EngineEvent]:
        with self._lock:
            if self._in_step:
                raise StepReentered("step() entered twice")
            self._in_step = True
            inbox, self._inbox = self._inbox, []
        try:
            self.steps += 1
            if self.steps == self.fail_at_step:
                raise ScriptedFailure(f"scripted failure at step {self.steps}")
            events: list[EngineEvent] = []
            for kind, arg in inbox:
                events += self._apply(kind, arg)
            if on_prefill is not None and events:  # as the engine: cancel finishes out first
                handed, events = events, []
                on_prefill(handed)
            prefilled = self._admit(on_prefill, events)
            decoded: list[EngineEvent] = []
            for seq in list(self._running.values()):
                if not seq.is_paused and seq.request.request_id not in prefilled:
                    decoded += self._generate(seq)
            if on_prefill is not None and prefilled and decoded and self.mixed_step:
                on_prefill(decoded)
                return events
            return events + decoded
        finally:
            self._in_step = False

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            blocks_total=self.blocks_total,
            blocks_free=self.blocks_free,
            blocks_reserved=self.blocks_total - self.blocks_free,
            running=len(self._running),
            waiting=len(self._waiting),
            paused=sum(seq.is_paused for seq in self._running.values()),
            admitted=len(self.admitted),
            releases=sum(self.releases.values()),
            steps=self.steps,
            last_step_ms=None,
            median_decode_step_ms=None,
        )

    # -- for assertions ----------------------------------------------------------

    @property
    def is_whole(self) -> bool:
        """Every block free and nothing running or waiting."""
        return self.blocks_free == self.blocks_total and not self._running and not self._waiting

    def is_paused(self, request_id: str) -> bool:
        seq = self._running.get(request_id)
        return seq is not None and seq.is_paused

    def blocks_held(self, request_id: str) -> int:
        seq = self._running.get(request_id)
        return 0 if seq is None else seq.blocks

    # -- inside step() ------------------------------------------------------------

    def _apply(self, kind: str, arg: GenerationRequest | str) -> list[EngineEvent]:
        if isinstance(arg, GenerationRequest):
            prompt_tokens = len(arg.prompt.split())
            self._waiting.append(
                _Sequence(arg, prompt_tokens, self._blocks_for(prompt_tokens, arg))
            )
            return []
        waiting = next((s for s in self._waiting if s.request.request_id == arg), None)
        running = self._running.get(arg)
        if kind == "cancel" and waiting is not None:
            self._waiting.remove(waiting)
            self.log.append((self.steps, kind, arg))
            return [self._finish(waiting, FinishReason.CANCELLED)]
        if waiting is not None:  # as the engine: admitted paused, prefilled once resumed
            waiting.is_paused = kind == "pause"
            return []
        if running is None:
            return []  # unknown or finished: ignored
        self.log.append((self.steps, kind, arg))
        if kind == "cancel":
            self._release(running)
            return [self._finish(running, FinishReason.CANCELLED)]
        running.is_paused = kind == "pause"
        return []

    def _admit(self, on_prefill: OnPrefill | None, events: list[EngineEvent]) -> set[str]:
        while self._waiting and len(self._running) < self.batch_limit:
            if self._waiting[0].blocks > self.blocks_free:
                break
            seq = self._waiting.popleft()
            self.blocks_free -= seq.blocks
            self._running[seq.request.request_id] = seq
            self.admitted.append(seq.request.request_id)
        prefilled: set[str] = set()
        for seq in list(self._running.values()):
            if seq.is_paused or seq.generated:
                continue  # paused before its prefill, or prefilled already
            request_id = seq.request.request_id
            prefilled.add(request_id)
            if self.before_prefill is not None:
                self.before_prefill(request_id)
            first = self._generate(seq)
            if on_prefill is None:
                events += first
            else:
                on_prefill(first)
        return prefilled

    def _generate(self, seq: _Sequence) -> list[EngineEvent]:
        request_id = seq.request.request_id
        if request_id in self.fail_requests and seq.generated:
            self._release(seq)
            return [self._finish(seq, FinishReason.ERROR, "scripted sequence failure")]
        token = TokenEvent(request_id, seq.generated, seq.generated, f" t{seq.generated}")
        seq.generated += 1
        if seq.generated < seq.request.max_new_tokens:
            return [token]
        self._release(seq)
        return [token, self._finish(seq, FinishReason.LENGTH)]

    def _finish(
        self, seq: _Sequence, reason: FinishReason, error: str | None = None
    ) -> FinishEvent:
        with self._lock:
            self._live.discard(seq.request.request_id)
        request_id = seq.request.request_id
        return FinishEvent(request_id, reason, seq.prompt_tokens, seq.generated, error)

    def _release(self, seq: _Sequence) -> None:
        request_id = seq.request.request_id
        if self.releases[request_id]:
            raise DoubleRelease(request_id)
        self.releases[request_id] += 1
        self.blocks_free += seq.blocks
        del self._running[request_id]

    def _blocks_for(self, prompt_tokens: int, request: GenerationRequest) -> int:
        return math.ceil((prompt_tokens + request.max_new_tokens) / self.block_size)


def fixed_cost_step(step_s: float = STEP_S) -> RunStep:
    """A ``run_step`` that costs ``step_s`` of (virtual) time, then steps inline."""

    async def run_step(fn: Callable[[], list[EngineEvent]]) -> list[EngineEvent]:
        await trio.sleep(step_s)
        return fn()

    return run_step


def assert_settled(engine: ScriptedEngine, hub: Hub) -> None:
    """No stream registered, the cache whole, every admitted request released once."""
    stats = hub.statistics()
    assert stats.streams_open == 0
    assert stats.engine_requests == 0
    assert engine.is_whole
    assert engine.releases == Counter(engine.admitted)


@asynccontextmanager
async def open_hub(
    engine: ScriptedEngine,
    settings: HubSettings | None = None,
    *,
    run_step: RunStep | None = None,
    stream_type: type[TokenStream] | None = None,
) -> AsyncIterator[Hub]:
    """A running hub over ``engine``; on a clean exit, shut down and assert_settled.
    ``run_step`` and ``stream_type``: as ``Hub``'s (the lab's naive device sets both).

    A test that would hang fails with trio.TooSlowError after HANG_GUARD_S instead.
    """
    hub = Hub(engine, settings or HubSettings(), run_step=run_step or fixed_cost_step(),
              stream_type=stream_type)
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            yield hub
            await hub.shutdown()
    assert_settled(engine, hub)


def request(
    request_id: str, max_new_tokens: int = 16, prompt: str = "a short prompt"
) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, max_new_tokens=max_new_tokens)

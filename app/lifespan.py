"""The server's life: load the model without blocking, run the hub, stop in order.

``Runtime`` owns the engine and the hub for one app and says whether streams may open.
It is the one place the engine is constructed (through ``make_engine``, which tests
replace); it knows the engine only as ``ServingEngine`` (the hub's ``StepEngine`` plus
``statistics()``) and imports nothing below the engine package root.

Theory of operation
-------------------
::

    NEW ──before_serving──> LOADING ──engine built, hub started──> READY
                               │                                     │
                               └── load failed ──> FAILED <── a step raised
    NEW, LOADING or READY ──drain()──> DRAINING ──after_serving, hub stopped──> STOPPED
    FAILED ──after_serving──> STOPPED

``before_serving`` only starts a task in the app's nursery (quart-trio's
``app.nursery``, which lives as long as the ASGI lifespan) and returns, so hypercorn
serves at once: ``/health`` answers while the model loads. The task builds the engine in
a worker thread (``trio.to_thread.run_sync``; the event loop never blocks on loading),
then makes the hub and starts ``hub.run`` in the same nursery with ``nursery.start``.

Stopping: a drain. ``drain()`` is synchronous and idempotent, so any signal source
can call it (``drain.py`` has the CLI's: SIGTERM, and hypercorn's own shutdown event;
an embedding program calls it itself and can pass ``wait_drained`` to
``hypercorn.trio.serve`` as its ``shutdown_trigger``). From that moment streams are
refused (503 ``shutdown`` with ``Retry-After``; ``/ready`` says 503 too), and
``Hub.drain`` lets the open streams finish until ``SHUTDOWN_GRACE_S`` from then, ends
the rest with a last ``error`` event ``shutdown`` (each end asks the engine to cancel),
and steps the engine until it holds none of our requests: the cache is whole.
With a shared resume store, the resumable streams still running ``HANDOVER_LEAD_S``
before that deadline are handed over instead (``_hand_over``): they stop here without a
final event, their events in the store and their owner leases let go, and a resume on
another replica continues them. ``wait_drained`` returns then, after one log line that
says so.

hypercorn's own stop comes after the drain (SIGTERM to the app's process) or at the
same moment (its main process was signalled): it stops accepting, gives open
connections ``--graceful-timeout``, cancels the rest (``connection.py`` writes a cut
stream's last ``error`` event ``shutdown``, and its ``close()`` asks the engine to
cancel), and only then runs the ASGI lifespan shutdown: ``after_serving``, ``stop()``,
which drains if nobody did and waits for the hub to stop. When both start at the signal,
``--graceful-timeout`` must be at least ``SHUTDOWN_GRACE_S`` + ``drain.DRAIN_MARGIN_S``
(1 s), or hypercorn cuts the streams before the drain ends them. quart-trio puts a deadline
of ``BACKGROUND_TASK_SHUTDOWN_TIMEOUT`` on the app's nursery before ``after_serving``
runs; the factory sets it above the grace period (see ``stop_deadline_s``).
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import trio

import engine
import streams

from .errors import ApiError, ErrorType
from .settings import Settings

log = logging.getLogger("streamscope.app")

# After the grace period, shutdown still waits for the engine to apply the cancels: one
# or two steps. This bounds that wait generously (a step of a small model on a CPU is
# tens of milliseconds) without letting a wedged engine hold the process forever.
STOP_MARGIN_S = 10.0
# The Retry-After of a refusal while the server drains or stops: a load balancer sends
# the retry to another replica at once; a lone server is gone or restarting by then.
SHUTDOWN_RETRY_AFTER_S = 1.0
# The Retry-After of a refusal while the model loads: a replica that has just (re)started
# answers before it can serve; a client that retries, through the balancer, gets another.
LOADING_RETRY_AFTER_S = 1.0
# /ready asks the shared resume store (Redis) for an answer this long at most: a health
# check (HAProxy's, every second) must not hang on a store that does not answer.
STORE_CHECK_TIMEOUT_S = 0.5
# With a shared resume store, a drain hands its resumable streams still running over to
# another replica this long before its deadline (instead of ending them with shutdown):
# before the hub's end at the deadline, with time to ask the store (half of it at most)
# and put their last events in it. A shorter grace period hands them over at once.
HANDOVER_LEAD_S = 0.5

# Prompts encoded at once, each in a worker thread. The engine encodes with one tokenizer
# copy under one lock, so a second thread would only wait there, uncancellably; queued
# here instead, a request whose client leaves costs nothing.
TOKENIZE_THREADS = 1
# A prompt this short is encoded on the event loop when the encoder is free: at most about
# 0.2 ms (30 characters: 26 us; 1,024: 0.31-0.33 ms, tiny and embedded tokenizers), where a
# worker thread's round trip waits for the loop's next turn: with 256 streams writing, a
# burst of 256 requests took seconds to reach the engine one thread hop at a time.
INLINE_ENCODE_CHARS = 512


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


class StreamHolder(Protocol):
    """Who owns a stream from the moment it opens: the request's connection
    (``serving.ConnectionOwner``) or the resumption registry (``resumable.py``)."""

    def own(self, stream: streams.TokenStream) -> None:
        """Take ``stream``: close it on every way out. Sync, never a checkpoint."""
        ...


def load_engine_from_settings(settings: Settings) -> ServingEngine:
    """The production ``make_engine``: load the model (imports torch, blocks for seconds)."""
    return engine.load_engine(
        settings.model,
        settings.device,
        max_batch=settings.max_batch,
        max_prefill_tokens=settings.max_prefill_tokens,
        max_step_ms=settings.max_step_ms,
        num_blocks=settings.cache_blocks,
        block_size=settings.block_size,
        cache_memory=settings.cache_memory,
        kv_admission=settings.kv_admission,
    )


def stop_deadline_s(settings: Settings) -> float:
    """How long ``after_serving`` may take: the grace period and then a few steps."""
    return settings.shutdown_grace_s + STOP_MARGIN_S


class Phase(enum.Enum):
    """Where the server is in its life (see the module docstring)."""

    NEW = "new"  # made; before_serving has not run; refusing
    LOADING = "loading"  # the model loads in a worker thread; refusing with not_ready
    READY = "ready"  # the engine is loaded and the hub runs; streams open
    FAILED = "failed"  # the load or a step raised; refusing with unavailable
    DRAINING = "draining"  # drain() began: refusing with shutdown; open streams finish
    STOPPED = "stopped"  # the hub stopped; the engine holds none of our requests


_REFUSALS = {
    Phase.NEW: (ErrorType.NOT_READY, "the server has not started"),
    Phase.LOADING: (ErrorType.NOT_READY, "the model is still loading"),
    Phase.FAILED: (ErrorType.UNAVAILABLE, "the engine failed"),
    Phase.DRAINING: (ErrorType.SHUTDOWN, "the server is stopping"),
    Phase.STOPPED: (ErrorType.SHUTDOWN, "the server has stopped"),
}


class Runtime:
    """The engine and hub of one app, and the phase that says whether streams may open.

    Args:
        settings: the server's settings.
        make_engine: builds the engine from settings; runs in a worker thread.
    """

    def __init__(self, settings: Settings, make_engine: MakeEngine) -> None:
        self.settings = settings
        self._make_engine = make_engine
        self.phase = Phase.NEW
        self.engine: ServingEngine | None = None
        self.hub: streams.Hub | None = None
        self.resumption: streams.ResumeRegistry | None = None  # with the hub
        self.rebuild: streams.Rebuild | None = None  # failover (app/failover.py sets it)
        self.failure: str | None = None  # why the phase is FAILED
        self._load_scope = trio.CancelScope()
        self._settled = trio.Event()  # set when the phase leaves NEW and LOADING
        self._nursery: trio.Nursery | None = None  # the app's, from start()
        self._drain_started = False
        self._hub_draining = False  # drain() told a running hub to drain
        self._drained = trio.Event()  # the drain is over: the hub stopped (or never ran)
        self._tokenize_limiter = trio.CapacityLimiter(TOKENIZE_THREADS)

    # -- lifespan hooks --------------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        """``before_serving``: start loading in ``nursery`` (the app's) and return."""
        if self.phase is not Phase.NEW:
            raise RuntimeError(f"the runtime starts once (phase: {self.phase.value})")
        self.phase = Phase.LOADING
        self._nursery = nursery
        nursery.start_soon(self._load_and_run, nursery)

    def drain(self, why: str) -> None:
        """Refuse new streams, let the open ones finish until ``SHUTDOWN_GRACE_S`` from
        now, then end the rest with ``error: shutdown`` (see the module docstring).

        Any signal source may call it: synchronous, idempotent, never a checkpoint.
        ``why`` goes into the log line. A load in progress is abandoned.
        """
        if self._drain_started:
            return
        self._drain_started = True
        self._load_scope.cancel(reason="the server stopped before the model was loaded")
        was = self.phase
        if was in (Phase.NEW, Phase.LOADING, Phase.READY):
            self.phase = Phase.DRAINING
        if self.resumption is not None:
            self.resumption.drain()  # remote readers end now: their clients resume elsewhere
        if was is Phase.READY and self.hub is not None and self._nursery is not None:
            self.hub.drain()
            self._hub_draining = True
            log.warning("draining (%s): %d streams open, refused from now on; the rest end "
                        "in %.1f s", why, self.hub.statistics().streams_open,
                        self.settings.shutdown_grace_s)
            self._nursery.start_soon(self._finish_drain, trio.current_time())
        else:
            log.warning("stopping (%s) in phase %s: nothing to drain", why, was.value)
            self._drained.set()

    async def wait_drained(self) -> None:
        """Wait until a drain (begun by ``drain()``; this does not begin one) is over: the
        hub stopped, and the engine holds none of our requests, so its cache is whole.

        Cancellation: nothing changes; the caller just stops waiting.
        """
        await self._drained.wait()

    async def stop(self) -> None:
        """``after_serving``: drain if nobody did, and wait until the hub stopped.

        Cancellation: the remaining streams are ended at once (``Hub.shutdown``) and
        Cancelled propagates; the hub's own task is cancelled with the app's nursery.
        """
        self.drain("the server is stopping")
        try:
            if self._hub_draining and self.hub is not None:
                await self.hub.shutdown()
        finally:
            self.phase = Phase.STOPPED
            self._settled.set()

    async def wait_settled(self) -> Phase:
        """Wait until loading is over (READY, FAILED or later); return the phase then.

        Cancellation: nothing changes; the caller just stops waiting.
        """
        await self._settled.wait()
        return self.phase

    # -- for the routes --------------------------------------------------------------

    async def open_stream(
        self,
        request: engine.GenerationRequest,
        policy: streams.PolicyName | None,
        *,
        owner: StreamHolder,
        resume_from: Sequence[int] = (),
    ) -> streams.TokenStream:
        """Encode the prompt (unless ``request.prompt_token_ids`` holds it), then submit
        ``request`` to the hub and open its stream, or refuse (the engine checks the
        prompt's token budget at the submit). ``owner`` takes the stream in the same
        call, before any checkpoint: no caller can forget to own what it opened.
        ``resume_from``: the tokens it made already on a replica that died (failover).

        The prompt is encoded in a worker thread (a 32k-character prompt takes tens of
        milliseconds: never on the event loop), ``TOKENIZE_THREADS`` at a time, by the
        engine's ``tokenize``, whose tokenizer the stepping thread never uses.

        Raises:
            ApiError: not ready, stopping or failed (503), before or after the encode.
            streams.DeadlineUnmeetable: by the estimate without the prompt's tokens,
                before the encode (no wait in its queue), or with them after it.
            streams.WaitingLimitReached, streams.NotAccepting, engine.InvalidRequest:
                from ``Hub.open_stream``; nothing was submitted.

        Cancellation: while queued for a tokenizer thread, or while an encode runs (it
        is never abandoned; it takes milliseconds): nothing was submitted. The open
        itself and the hand-over to ``owner`` have no checkpoint: the owner holds the
        stream as soon as it exists.
        """
        request = await self.encoded(request)
        hub = self._raise_refusal()  # the phase may have changed meanwhile
        stream = hub.open_stream(request, policy=policy, resume_from=resume_from)
        owner.own(stream)
        return stream

    async def encoded(self, request: engine.GenerationRequest) -> engine.GenerationRequest:
        """``request`` with its ``prompt_token_ids`` (``open_stream``'s encode, which it
        skips for a request that has them), refused as there before the encode.

        Cancellation: as ``open_stream``'s before the open: nothing was submitted.
        """
        self._raise_refusal().check_deadline(request)  # before the encode's queue
        assert self.engine is not None  # READY: built
        if request.prompt_token_ids is None:  # else render_chat encoded it
            ids: tuple[int, ...] | None = None
            if len(request.prompt) <= INLINE_ENCODE_CHARS:
                await trio.lowlevel.checkpoint()
                inline = self.engine.tokenize_if_free(request.prompt)
                ids = None if inline is None else tuple(inline)
            if ids is None:
                tokenize = partial(_prompt_ids, self.engine, request.prompt)
                ids = await trio.to_thread.run_sync(tokenize, limiter=self._tokenize_limiter)
            request = replace(request, prompt_token_ids=ids)
        else:
            await trio.lowlevel.checkpoint()
        return request

    async def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
    ) -> tuple[str, tuple[int, ...]]:
        """Chat messages as the model's chat template renders them: the prompt text and
        its token ids (give both to ``open_stream`` in a ``GenerationRequest``).

        Templating is tokenizer work: it runs in a worker thread like ``open_stream``'s
        encode, under the same limiter, by the engine's ``render_chat``.

        Raises:
            ApiError: not ready, stopping or failed (503).
            engine.ChatTemplateError: no chat template, or it refused the messages.

        Cancellation: while queued or rendering (never abandoned; milliseconds):
        nothing was made.
        """
        self._raise_refusal()
        assert self.engine is not None  # READY: built
        render = partial(self.engine.render_chat, messages, add_generation_prompt)
        text, ids = await trio.to_thread.run_sync(render, limiter=self._tokenize_limiter)
        return text, tuple(ids)

    def resume_registry(self) -> streams.ResumeRegistry:
        """The registry of resumable streams (it runs while the hub does), or the
        refusal (503) before the model is loaded or after a failed load."""
        if self.resumption is None:
            raise self.refusal() or ApiError(ErrorType.UNAVAILABLE, "no resume registry")
        return self.resumption

    def _raise_refusal(self) -> streams.Hub:
        refusal = self.refusal()
        if refusal is not None or self.hub is None:
            raise refusal or ApiError(ErrorType.UNAVAILABLE, "the hub is missing")
        return self.hub

    def refusal(self) -> ApiError | None:
        """Why streams cannot open now (not ready, failed, stopping), or None."""
        if self.phase is Phase.READY:
            return None
        error_type, message = _REFUSALS[self.phase]
        if self.phase is Phase.FAILED:
            message = f"{message}: {self.failure}"
        if error_type is ErrorType.SHUTDOWN:
            return ApiError(error_type, message, retry_after_s=SHUTDOWN_RETRY_AFTER_S)
        if error_type is ErrorType.NOT_READY:
            return ApiError(error_type, message, retry_after_s=LOADING_RETRY_AFTER_S)
        return ApiError(error_type, message)

    async def store_refusal(self) -> ApiError | None:
        """With ``STREAMSCOPE_RESUME_STORE``: 503 ``unavailable`` when the store does not
        answer within ``STORE_CHECK_TIMEOUT_S`` (``/ready``: a balancer takes this
        replica out, for a resume of another replica's stream would fail here); None
        when it answers or there is none.

        Cancellation: the answer is not waited for (the ask is abandoned to its thread).
        """
        if self.resumption is None:
            await trio.lowlevel.checkpoint()
            return None
        with trio.move_on_after(STORE_CHECK_TIMEOUT_S):
            if await self.resumption.store_answers():
                return None
        return ApiError(ErrorType.UNAVAILABLE, "the shared resume store "
                        "(STREAMSCOPE_RESUME_STORE) does not answer",
                        retry_after_s=LOADING_RETRY_AFTER_S)

    def finished(self, request_id: str) -> engine.FinishEvent | None:
        """How the engine let ``request_id`` go (``Hub.finished``), or None: unknown, not
        finished yet, forgotten (the hub keeps the most recent finishes), or no hub."""
        return None if self.hub is None else self.hub.finished(request_id)

    def statistics(self) -> dict[str, Any]:
        """``/stats``: the engine's and the hub's counters, flat; None where unknown."""
        result: dict[str, Any] = {
            "phase": self.phase.value,
            "model": self.settings.model,
            "device": self.settings.device or "auto",
            "policy": self.settings.policy.value,
        }
        result.update(_engine_fields(self.engine))
        result.update(_hub_fields(self.hub))
        result.update(_resume_fields(self.resumption))
        return result

    # -- the background task ---------------------------------------------------------

    async def _load_and_run(self, nursery: trio.Nursery) -> None:
        """Build the engine in a worker thread, then start the hub in ``nursery``.

        Cancellation: at the load (``stop()`` or the app's nursery), the worker thread is
        abandoned (a load touches no shared state; it finishes or dies with the process);
        nothing was made. At ``nursery.start``: the hub never ran.
        """
        try:
            with self._load_scope:
                built = await trio.to_thread.run_sync(
                    partial(_build_and_freeze, self._make_engine, self.settings),
                    abandon_on_cancel=True,
                )
            if self._load_scope.cancelled_caught or self.phase is not Phase.LOADING:
                return
            self.engine = built
            self.hub = streams.Hub(built, self.settings.hub_settings())
            self.resumption = streams.ResumeRegistry(
                _resume_log(self.settings), grace_s=self.settings.resume_grace_s,
                max_detached_bytes=self.settings.resume_max_bytes, rebuild=self.rebuild,
            )
            await nursery.start(self.resumption.run)
            await nursery.start(self._run_hub, self.hub)
        except Exception as exc:
            self._fail(f"loading the model failed: {exc!r}", exc)
            return
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
            log.info("ready: model %s, policy %s", self.settings.model, self.settings.policy.value)
        self._settled.set()

    async def _run_hub(
        self, hub: streams.Hub, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the hub; a failed step makes the server FAILED instead of ending the lifespan.

        Cancellation: the hub ends every open stream with ``shutdown`` and returns.
        """
        try:
            await hub.run(task_status=task_status)
        except Exception as exc:
            self._fail(f"the engine failed: {exc!r}", exc)

    async def _finish_drain(self, began: float) -> None:
        """Wait for the hub to stop (and for a hand-over of resumable streams to the
        store, ``_hand_over``), say so in the log, and mark the drain over.

        Cancellation: (the app's nursery, at its shutdown deadline) the remaining
        streams are ended at once (``Hub.shutdown``); the drain is then not over.
        """
        assert self.hub is not None and self.engine is not None
        hub_stopped = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._hand_over, began + self.settings.shutdown_grace_s,
                               hub_stopped)
            await self.hub.shutdown()
            hub_stopped.set()
        stats = self.engine.statistics()
        log.warning("drained in %.2f s: the engine holds none of our requests; cache whole: "
                    "%s, %d of %d blocks free", trio.current_time() - began,
                    stats.blocks_free == stats.blocks_total, stats.blocks_free,
                    stats.blocks_total)
        self._drained.set()

    async def _hand_over(self, deadline: float, hub_stopped: trio.Event) -> None:
        """``HANDOVER_LEAD_S`` before the drain's ``deadline``, unless the hub stopped
        first (every stream ended): leave the resumable streams still running to
        another replica (``ResumeRegistry.hand_over``: with a shared store only; the
        rest end with ``shutdown`` at the deadline as before), and wait (bounded) until
        the store has their events. Not if the store does not answer then: they end
        with ``shutdown``, which their clients can still read here.

        Cancellation: (with the drain's) before the hand-over, nothing changes; after,
        only the wait for the store stops (the streams are handed over).
        """
        registry = self.resumption
        with trio.move_on_at(deadline - HANDOVER_LEAD_S):
            await hub_stopped.wait()
        if hub_stopped.is_set() or registry is None or self.settings.resume_store is None:
            return
        answers = False
        with trio.move_on_after(HANDOVER_LEAD_S / 2):
            answers = await registry.store_answers()
        if not answers:
            log.warning("draining: the resume store does not answer; resumable streams "
                        "still running end with shutdown")
            return
        with trio.move_on_at(deadline + HANDOVER_LEAD_S) as waited:
            try:
                handed = await registry.hand_over()
            except streams.StoreUnavailable as exc:
                log.warning("draining: resumable streams handed over, but %s", exc)
                return
        if waited.cancelled_caught:
            log.warning("draining: resumable streams handed over; the store did not "
                        "take their last events in time")
        elif handed:
            log.warning("draining: %d resumable streams handed over to the other "
                        "replicas (a resume takes each over)", handed)

    def _fail(self, message: str, exc: BaseException) -> None:
        log.error("%s", message, exc_info=(type(exc), exc, exc.__traceback__))
        self.failure = message
        if self.phase in (Phase.LOADING, Phase.READY):
            self.phase = Phase.FAILED
        self._settled.set()


def _build_and_freeze(make_engine: MakeEngine, settings: Settings) -> ServingEngine:
    """In a worker thread: build the engine, then take every object alive then out of the
    cyclic garbage collector's reach (``gc.freeze``). With the embedded model loaded a
    full collection walks about 400,000 objects (mostly the functions and tuples of
    transformers' modules), which held the event loop for 0.2-0.5 s each time it ran;
    after the freeze, collections walk only what the serving allocates."""
    built = make_engine(settings)
    gc.collect()  # garbage left by the load: frozen, it would stay forever
    gc.freeze()
    return built


def _prompt_ids(eng: ServingEngine, prompt: str) -> tuple[int, ...]:
    """In a worker thread: the prompt's token ids, as ``GenerationRequest`` holds them."""
    return tuple(eng.tokenize(prompt))


# /stats is the three statistics dataclasses flattened (``dataclasses.asdict``), each
# field under its own name but these, renamed where a name alone would be unclear among
# the others; a new statistics field shows up in /stats by itself.
_HUB_KEYS = {"state": "hub_state", "waiting": "streams_waiting", "steps": "hub_steps"}
_RESUME_KEYS = {"streams": "resumable_streams", "detached": "resumable_detached",
                "log_bytes": "resume_log_bytes", "detached_bytes": "resume_detached_bytes",
                "expiries": "resume_expiries", "overflows": "resume_overflows",
                "cancels": "resume_cancels", "failovers": "resume_failovers",
                "disowned": "resume_disowned", "handed_over": "resume_handed_over"}


def _flat(stats: Any, kind: type, keys: Mapping[str, str], absent: object) -> dict[str, Any]:
    """``stats`` (a dataclass of type ``kind``, or None) as /stats keys; enums as their
    values; every field ``absent`` (but ``hub_state``: None) when there is none yet."""
    if stats is None:
        return {keys.get(f.name, f.name): absent for f in dataclasses.fields(kind)}
    return {keys.get(name, name): getattr(value, "value", value)
            for name, value in dataclasses.asdict(stats).items()}


def _engine_fields(eng: ServingEngine | None) -> dict[str, Any]:
    stats = eng.statistics() if eng is not None else None
    return _flat(stats, engine.EngineStatistics, {}, None)


def _hub_fields(hub: streams.Hub | None) -> dict[str, Any]:
    fields = _flat(hub.statistics() if hub is not None else None, streams.HubStatistics,
                   _HUB_KEYS, 0)
    if hub is None:
        fields.update(hub_state=None, last_error=None)
    return fields


def _resume_log(settings: Settings) -> streams.EventLog:
    """The log of resumable streams the settings choose: memory, or a shared Redis whose
    keys outlive their owner by the grace period (``streams/redis_log.py``)."""
    if settings.resume_store is None:
        return streams.MemoryEventLog()
    from streams.redis_log import RedisEventLog  # redis-py only where it is used

    return RedisEventLog.from_url(settings.resume_store, ttl_s=settings.resume_grace_s,
                                  owner_lease_s=settings.owner_lease_s)


def _resume_fields(registry: streams.ResumeRegistry | None) -> dict[str, Any]:
    stats = registry.statistics() if registry is not None else None
    return _flat(stats, streams.ResumeStatistics, _RESUME_KEYS, 0)

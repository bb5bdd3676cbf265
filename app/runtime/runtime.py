"""The server's life: load the model without blocking, run the hub, stop in order.

``Runtime`` owns the engine and the hub for one app and says whether streams may open
(its ``phase``, ``phase.py``). It is the one place the engine is constructed (through a
``MakeEngine``, ``loading.py``, which tests replace). It knows no Quart: the routes call
it, and the factory's lifespan hooks start and stop it.

Theory of operation
-------------------
``start`` (``before_serving``) only starts a task in the app's nursery (quart-trio's
``app.nursery``, which lives as long as the ASGI lifespan) and returns, so hypercorn
serves at once: ``/health`` answers while the model loads. The task builds the engine in
a worker thread (``trio.to_thread.run_sync``; the event loop never blocks on loading),
then makes the hub and the resume registry and starts them in the same nursery with
``nursery.start``.

A stream opens in two steps: ``prepare`` (async: the refusals, the deadline check, the
prompt's encode or the chat template's rendering, ``prompts.py``) and ``open`` (sync:
the phase again, then ``Hub.open_stream``). The caller hands the stream to its closer
(the connection's ``close_with_connection``, or the resume registry) right after
``open``, with no checkpoint between: nothing can cancel a stream that nobody closes.

Stopping: a drain. ``drain()`` is synchronous and idempotent, so any signal source can
call it (``app/edge/signals.py``; an embedding program calls it itself and can pass
``wait_drained`` to ``hypercorn.trio.serve`` as its ``shutdown_trigger``). From that
moment streams are refused (503 ``shutdown`` with ``Retry-After``; ``/ready`` says 503
too) and the hub drains (``draining.py``: the grace period, the hand-over of resumable
streams, the cache whole); ``wait_drained`` returns then. hypercorn's lifespan shutdown
runs ``stop()`` (``after_serving``), which drains if nobody did and waits for the hub.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import PurePath
from typing import Any

import trio

import engine
import streams
from streams.resume import Rebuild, ResumeRegistry

from ..errors import ApiError, ErrorType
from ..key_shares import KeyShares
from ..new_tokens import fit_new_tokens
from ..settings import Settings
from .draining import finish_drain
from .loading import MakeEngine, MakeHub, ServingEngine, build_and_freeze
from .phase import Phase, refusal
from .prompts import TokenizerQueue
from .stats import statistics_fields
from .store import resume_log, shared_store, store_refusal

log = logging.getLogger("streamscope.app")


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to open (``Runtime.prepare``): refused nothing, encoded."""

    request: engine.GenerationRequest  # with its prompt_token_ids
    policy: streams.PolicyName | None
    resume_from: tuple[int, ...] = ()  # tokens made already on a replica that died


class Runtime:
    """The engine and hub of one app, and the phase that says whether streams may open.

    Args:
        settings: the server's settings.
        make_engine: builds the engine from settings; runs in a worker thread.
        make_hub: makes the hub over the built engine (``create_app``'s); none:
            ``streams.Hub``.
    """

    def __init__(
        self,
        settings: Settings,
        make_engine: MakeEngine,
        *,
        make_hub: MakeHub | None = None,
    ) -> None:
        self.settings = settings
        self._make_engine = make_engine
        self._make_hub = make_hub  # None: ``streams.Hub`` (looked up when the hub is made)
        self.phase = Phase.NEW
        self.engine: ServingEngine | None = None
        self.hub: streams.Hub | None = None
        self.resumption: ResumeRegistry | None = None  # with the hub
        self.rebuild: Rebuild | None = None  # failover (the resumable routes set it)
        self.failure: str | None = None  # why the phase is FAILED
        self.shares = KeyShares.from_settings(settings)  # None: no API keys
        # The one client and signer of the shared Redis (None without one): the resume
        # log's and the Responses API store's (store.py).
        self.shared_store = shared_store(settings)
        self._load_scope = trio.CancelScope()
        self._loading_over = trio.Event()  # set when the phase leaves NEW and LOADING
        self._nursery: trio.Nursery | None = None  # the app's, from start()
        self._drain_started = False
        self._hub_draining = False  # drain() told a running hub to drain
        self._drained = trio.Event()  # the drain is over: the hub stopped (or never ran)
        self._prompts = TokenizerQueue()
        # Every stream body's keep-alive timer (streams/keepalive.py), ticking from start().
        self.keepalives = streams.Keepalives(settings.keepalive_s)

    # -- lifespan hooks --------------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        """``before_serving``: start loading in ``nursery`` (the app's) and return."""
        if self.phase is not Phase.NEW:
            raise RuntimeError(f"the runtime starts once (phase: {self.phase.value})")
        self.phase = Phase.LOADING
        self._nursery = nursery
        nursery.start_soon(self.keepalives.run)
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

        Cancellation: nothing to undo: a wait; the drain goes on in the hub, bounded by
        its own deadline (``SHUTDOWN_GRACE_S``).
        """
        await self._drained.wait()

    async def stop(self) -> None:
        """``after_serving``: drain if nobody did, and wait until the hub stopped.

        Cancellation: (quart-trio's deadline on the app's nursery, ``stop_deadline_s``,
        which this hook runs inside) each remaining stream is closed by its owner's
        stand-in, the hub, at once (``Hub.shutdown``: the same engine cancel as a
        ``close()``), and Cancelled propagates; the hub's own task is cancelled with the
        same nursery, so nobody steps the engine after that and those cancels stay
        unapplied: the server is ending. The phase is STOPPED on every way out.
        """
        self.drain("the server is stopping")
        try:
            if self._hub_draining and self.hub is not None:
                await self.hub.shutdown()
        finally:
            self.phase = Phase.STOPPED
            self._loading_over.set()

    async def loading_outcome(self) -> Phase:
        """Wait until loading is over (READY, FAILED or later); return the phase then.

        Cancellation: nothing to undo: a wait; the load goes on in the app's nursery.
        """
        await self._loading_over.wait()
        return self.phase

    # -- for the routes --------------------------------------------------------------

    async def prepare(
        self,
        request: engine.GenerationRequest,
        policy: streams.PolicyName | None,
        *,
        resume_from: Sequence[int] = (),
        new_tokens_field: str = "max_new_tokens",
    ) -> Prepared:
        """Everything before a stream opens: the refusals, the deadline check, the
        prompt's encode (skipped for a request that has its ``prompt_token_ids``) and,
        with the prompt's tokens counted, its new tokens (``app/new_tokens.py``: the
        request's ``UNTIL_CONTEXT`` filled in, or a limit the context cannot hold
        refused, naming ``new_tokens_field``, the request's own name for it).
        ``open`` then opens it with no checkpoint. ``resume_from``: the tokens it made
        already on a replica that died (failover).

        Raises:
            ApiError: not ready, stopping or failed (503); new tokens the context cannot
                hold with the prompt (invalid_request), a prompt that fills it.
            streams.DeadlineUnmeetable: by the estimate without the prompt's tokens,
                before the encode (no wait in its queue).
            engine.InvalidConstraint: its constraint does not compile, or costs too
                much (422).
            ApiError: 429 too_many_waiting: its constraint had no turn to compile in
                time (``prompts.COMPILE_WAIT_S``).

        Cancellation: nothing to undo: nothing is submitted before ``open``. A cancel
        while queued for a tokenizer or compile thread lands at once; an encode or a
        compile in flight is finished first (a compile writes the engine's constraint
        cache, which must stay whole: milliseconds, seconds for the very first compile),
        then the cancel lands.
        """
        self._ready_hub().check_deadline(request)  # before the encode's queue
        assert self.engine is not None  # READY: built
        credential = None if self.shares is None else self.shares.owner(request.request_id)
        owner = None if credential is None else credential.name  # None: its tenant
        encoded = fit_new_tokens(await self._prompts.encode(self.engine, request, owner),
                                 self.engine.max_positions, field=new_tokens_field,
                                 cap=self.settings.max_new_tokens_limit,
                                 default=self.settings.default_max_new_tokens)
        if request.constraint is not None:  # compiled off the loop, before any byte
            await self._prompts.compile(  # in the tenant's cache, within its key's share
                self.engine, request.constraint, request.cache_namespace, owner)
        return Prepared(encoded, policy, tuple(resume_from))

    async def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
        owner: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, tuple[int, ...]]:
        """Chat messages (and ``tools``, function definitions for a template that renders
        its own: ``ChatBody.template_tools``) as the model's chat template renders them:
        the text and its token ids, in one worker-thread call, in ``owner``'s turn (the
        API key's name;
        None: one turn shared by every caller that names none). The route then builds
        its request of them and calls ``prepare`` (which keeps the ids), as for a prompt.

        Raises:
            ApiError: not ready, stopping or failed (503).
            engine.ChatTemplateError: no chat template, or it refused the messages.

        Cancellation: nothing to undo: a render makes nothing anyone must own. A cancel
        while queued for the tokenizer's thread lands at once; a render in flight is
        finished first (milliseconds), then the cancel lands.
        """
        self._ready_hub()
        assert self.engine is not None  # READY: built
        return await self._prompts.render_chat(self.engine, messages, add_generation_prompt,
                                               owner, tools)

    def open(self, prepared: Prepared, *, resumable: bool = False,
             rebuilt: bool = False) -> streams.TokenStream:
        """Submit a prepared request to the hub and open its stream, or refuse. The
        engine checks the prompt's token budget and the deadline, with the prompt's
        tokens, at the submit. With API keys, the stream counts against the key that
        owns its id (``key_shares.py``): refused past the key's fair share of the
        waiting streams or (``resumable``) of the resumable ones, unless ``rebuilt``
        (a failover's continuation, counted as resumable but never refused by a share).

        Sync, never a checkpoint: the caller hands the stream to its closer (the
        connection's ``close_with_connection``, or the resume registry) before anything
        can cancel it.

        Raises:
            ApiError: the phase changed since ``prepare`` (503); the key's share (429
                key_limit).
            streams.DeadlineUnmeetable, streams.WaitingLimitReached, streams.NotAccepting,
                engine.InvalidRequest: from ``Hub.open_stream``; nothing was submitted.
        """
        hub, shares = self._ready_hub(), self.shares
        key = None if shares is None else shares.owner(prepared.request.request_id)
        if shares is not None and key is not None and not rebuilt:
            shares.check(key, resumable=resumable)
        stream = hub.open_stream(prepared.request, policy=prepared.policy,
                                 resume_from=prepared.resume_from)
        if shares is not None and key is not None:
            shares.opened(key, stream, resumable=resumable or rebuilt)
        return stream

    def resume_registry(self) -> ResumeRegistry:
        """The registry of resumable streams (it runs while the hub does), or the
        refusal (503) before the model is loaded or after a failed load."""
        if self.resumption is None:
            raise self.refusal() or ApiError(ErrorType.UNAVAILABLE, "no resume registry")
        return self.resumption

    def refusal(self) -> ApiError | None:
        """Why streams cannot open now (not ready, failed, stopping), or None."""
        return refusal(self.phase, self.failure)

    async def store_refusal(self) -> ApiError | None:
        """With ``STREAMSCOPE_RESUME_STORE``: 503 ``unavailable`` when the store does not
        answer in time (``store.py``); None when it answers or there is none.

        Cancellation: abandoned: a ping changes nothing, so the caller returns at once
        and the ask runs on in its thread until the store answers or its socket times
        out (``store.store_refusal``).
        """
        return await store_refusal(self.resumption)

    def finished(self, request_id: str) -> engine.FinishEvent | None:
        """How the engine let ``request_id`` go (``Hub.finished``), or None: unknown, not
        finished yet, forgotten (the hub keeps the most recent finishes), or no hub."""
        return None if self.hub is None else self.hub.finished(request_id)

    def statistics(self) -> dict[str, Any]:
        """``/stats``: the engine's and the hub's counters, flat; None where unknown."""
        result: dict[str, Any] = {
            "phase": self.phase.value,
            # a folder's name, never its path: /stats is for any key holder (issue 33)
            "model": PurePath(self.settings.model).name,
            "device": self.settings.device or "auto",
            "policy": self.settings.policy.value,
        }
        result.update(statistics_fields(self.engine, self.hub, self.resumption))
        return result

    def _ready_hub(self) -> streams.Hub:
        """The hub, if streams may open now; else raise the refusal."""
        why = self.refusal()
        if why is not None or self.hub is None:
            raise why or ApiError(ErrorType.UNAVAILABLE, "the hub is missing")
        return self.hub

    # -- the background tasks --------------------------------------------------------

    async def _load_and_run(self, nursery: trio.Nursery) -> None:
        """Build the engine in a worker thread, then start the hub in ``nursery``.

        Cancellation: at the load (``drain()``'s ``_load_scope``, or the app's nursery),
        abandoned: the worker thread runs on unowned, as a load touches no shared state;
        it finishes, its engine dropped, or dies with the process. Past the load, at
        either ``nursery.start``: nothing to undo, as no stream can open before the phase
        is READY, which is set only after both started.
        """
        try:
            with self._load_scope:
                built = await trio.to_thread.run_sync(
                    partial(build_and_freeze, self._make_engine, self.settings),
                    abandon_on_cancel=True,
                )
            if self._load_scope.cancelled_caught or self.phase is not Phase.LOADING:
                return
            self.engine = built
            self.hub = (self._make_hub or streams.Hub)(built, self.settings.hub_settings())
            self.resumption = ResumeRegistry(
                resume_log(self.settings, self.shared_store),
                grace_s=self.settings.resume_grace_s,
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
        self._loading_over.set()

    async def _run_hub(
        self, hub: streams.Hub, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the hub; a failed step makes the server FAILED instead of ending the lifespan.

        Cancellation: as ``Hub.run`` says: the step in flight is finished first, then
        every open stream is closed by the hub itself (StreamError ``shutdown``), and
        Cancelled propagates (it is no ``Exception``: the phase does not become FAILED).
        """
        try:
            await hub.run(task_status=task_status)
        except Exception as exc:
            self._fail(f"the engine failed: {exc!r}", exc)

    async def _finish_drain(self, began: float) -> None:
        """``draining.finish_drain``, then mark the drain over.

        Cancellation: (the app's nursery, at its shutdown deadline) each remaining
        stream is closed by its owner's stand-in, the hub, at once
        (``Hub.shutdown``: the same engine cancel as a ``close()``), applied only if
        something still steps the engine; ``wait_drained`` then never returns, as the
        drain is not over.
        """
        assert self.hub is not None and self.engine is not None
        await finish_drain(self.hub, self.engine, self.resumption, self.settings, began)
        self._drained.set()

    def _fail(self, message: str, exc: BaseException) -> None:
        log.error("%s", message, exc_info=(type(exc), exc, exc.__traceback__))
        self.failure = message
        if self.phase in (Phase.LOADING, Phase.READY):
            self.phase = Phase.FAILED
        self._loading_over.set()

"""The hub: the one task that steps the engine and fans its events out to streams.

The hub runs the engine's step loop (``step_loop.py``) and owns the registry of open
streams and the stall watchdog. It knows the engine only as ``StepEngine`` (a Protocol;
plain data in and out) and knows nothing of HTTP, SSE or torch.

Theory of operation
-------------------
One Trio task (``run``, started with ``nursery.start``) runs the step loop
(``step_loop.py``: when to step), which steps the engine through ``run_step`` (default
``trio.to_thread.run_sync``, never abandoned: a step is an uncancellable critical section
that mutates the cache), where a ``Stepper`` (``stepper.py``) runs steps back to back and
posts their events without waiting for the loop. Each event goes to its stream through
the stream's policy, synchronously: the loop never waits for a reader (the lab's
``naive``, which does, is a ``run_step``). The open streams, and the hub as they see it,
are ``open_streams.py``'s.

    NEW ──run()──> RUNNING ──drain()──> DRAINING ──engine holds nothing──> STOPPED
                      └──────── a step raised ─────────> FAILED

Draining. ``drain()`` (synchronous, idempotent: any signal source may call it) refuses
new streams and starts the deadline, ``shutdown_grace_s`` from that moment. The open
streams go on; at the deadline ``run``'s deadline task ends the rest with StreamError
``shutdown`` (which asks the engine to cancel each). The loop steps until the engine
holds none of the hub's requests, then ``run`` returns: the cache is whole.
``shutdown()`` is ``drain()`` and a wait for that.

The loop steps while the hub is RUNNING or the engine holds any of its requests, and
only when there is work: it sleeps otherwise until woken (open_stream, close, resume, a
drop, drain) or until the next TTFT deadline of a request in the engine.

Deadlines (``deadlines.py``). A request with a ``ttft_deadline`` is refused at
``open_stream`` when the engine's estimate of its first token is later; one admitted
but still unstarted at its deadline is let go by the engine (FinishReason.DEADLINE); its
stream ends with StreamError ``deadline_missed``.

Invariants:
- ``engine.submit``, ``cancel``, ``pause`` and ``resume`` are only wishes; the engine
  applies them at its next step. Besides them the hub calls only ``has_work()``, and
  only between steps.
- The router's ledger (``router.py``) is every request id submitted here whose
  FinishEvent has not yet arrived: while it is not empty the engine's cache is not
  whole. Events for an unregistered (closed) or ended stream are dropped and counted.

Cancellation: cancelling ``run`` is a stop that waits for no engine. The step in flight
is finished first (the default ``run_step`` waits for its thread: a step mutates the
cache), and its events are routed; then the hub, each stream's owner's stand-in, ends
every open stream with StreamError ``shutdown``, which posts the engine cancel a
``close()`` would (closed by its owner, outcome 2, with one difference): nobody steps the
engine after that, so those cancels stay unapplied and the cache is not whole. Only the
server's end cancels ``run`` (the app's nursery); ``shutdown()`` is the orderly way, and
leaves the cache whole.

Failure: if ``run_step`` raises, every open stream gets StreamError ``engine_error``,
the hub refuses new streams (FAILED, ``last_error``) and ``run`` re-raises it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import trio

from engine import (
    DuplicateRequestId,
    FinishEvent,
    GenerationRequest,
)

from .deadlines import TtftDeadlines
from .errors import NotAccepting, WaitingLimitReached
from .hub_types import HubSettings, HubState, HubStatistics, RunStep, StepEngine
from .open_streams import OpenStreams
from .policy import Policy, PolicyName
from .router import EventRouter
from .scope_feed import ScopeFeed
from .step_loop import StepLoop
from .stepper import Stepper
from .stream import ErrorType, StreamEnd, StreamError, StreamState, TokenStream


class Hub:
    """Runs the engine for many streams. See the module docstring.

    Args:
        engine: the engine; the hub is its only caller.
        settings: policy and limits.
        run_step: how to run the stepping (``Stepper.run_steps``): by default in a worker
            thread; tests pass one costing virtual time, the lab its ``naive`` device
            (``tools/lab/naive.py``: one step at a time, then a wait for the readers).
        stream_type: the class of the streams ``open_stream`` makes: by default
            ``TokenStream``; the lab's ``naive`` device passes its subclass, whose readers
            it can wait for.
    """

    def __init__(
        self,
        engine: StepEngine,
        settings: HubSettings = HubSettings(),  # noqa: B008 - frozen, safe to share
        *,
        run_step: RunStep = trio.to_thread.run_sync,
        stream_type: type[TokenStream] | None = None,
    ) -> None:
        self.settings = settings
        self._engine = engine
        self._stream_type = stream_type or TokenStream
        # A stream opened with no policy of its own has this very object (``open_stream``).
        self.default_policy = self._policy(settings.policy)  # validates the policy's limits
        # Its five parts, each made with the parts it reads: the open streams, the router
        # that fills them, the stepping thread (which holds events while their writers
        # are busy), the step loop over it, and the scope (the live view) over both.
        self._streams = OpenStreams(engine)
        self._deadlines = TtftDeadlines(engine)
        self._router = EventRouter(self._streams, self._deadlines)
        self._stepper = Stepper(engine, self._router.route, hold=self._streams.any_writing)
        self._loop = StepLoop(engine, self._stepper, run_step, self._deadlines)
        self.scope = ScopeFeed(self.default_policy, streams=self._streams,
                               stepping=self._stepper)
        # Then who reports back to a part made after it: the stepper to the scope, and
        # the streams to the loop (wake), the stepper (caught up) and the scope (closed).
        self._stepper.watch = self.scope
        self._streams.connect(wake=self._loop.wake, caught_up=self._stepper.caught_up,
                              closed=self.scope.closed)
        self._state = HubState.NEW
        self._stopped = trio.Event()
        self._draining = trio.Event()  # set by drain(); _drain_deadline is then valid
        self._drain_deadline = math.inf
        self._last_error: str | None = None
        self._opened = self._refused_waiting = 0
        self._step_errors = self._slow_client_drops = 0

    # -- lifecycle -----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Step the engine and watch for stalled readers, until shut down.

        Returns:
            After ``shutdown()``, once the engine holds none of the hub's requests.

        Raises:
            RuntimeError: the hub already ran.
            Exception: whatever ``run_step`` raised, re-raised as is after every open
                stream got StreamError ``engine_error`` (state FAILED).

        Cancellation:
            The step in flight is finished first (the default ``run_step`` waits for its
            thread) and its events are routed; every open stream is then closed by its
            owner's stand-in, the hub (StreamError ``shutdown`` and the engine cancel),
            and the engine is stepped no more, so those cancels stay unapplied (see the
            module docstring); Cancelled propagates.
        """
        if self._state is not HubState.NEW:
            raise RuntimeError(f"a hub runs once (state: {self._state.value})")
        self._stepper.bind()
        failure: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_stalls)
                nursery.start_soon(self._end_at_drain_deadline)
                nursery.start_soon(self._loop.stop_stepping_when_cancelled)
                self._state = HubState.RUNNING
                task_status.started()
                failure = await self._loop.run(self._keep_stepping)
                if failure is not None:
                    self._record_failure(failure)
                nursery.cancel_scope.cancel(reason="the hub's step loop ended")
        finally:
            if self._state is not HubState.FAILED:
                self._state = HubState.STOPPED
            self._end_all(ErrorType.SHUTDOWN, "the hub stopped", StreamEnd.SHUTDOWN)
            self._stopped.set()
        if failure is not None:
            raise failure

    def drain(self) -> None:
        """Refuse new streams from now on; let the open ones finish until
        ``shutdown_grace_s`` from now, then end the rest with StreamError ``shutdown``.
        ``run()`` returns once the engine applied their cancels (see the module
        docstring). Synchronous, idempotent, never a checkpoint."""
        if self._state is HubState.NEW:
            self._state = HubState.STOPPED
            self._stopped.set()
        elif self._state is HubState.RUNNING:
            self._state = HubState.DRAINING
            self._drain_deadline = trio.current_time() + self.settings.shutdown_grace_s
            self._draining.set()
            self._loop.wake()

    async def shutdown(self) -> None:
        """``drain()``, then wait until ``run()`` returned: every open stream finished or
        was ended with StreamError ``shutdown``, and the engine holds none of the hub's
        requests, so its cache is whole.

        Cancellation:
            While waiting: each remaining stream is closed by its owner's stand-in, the
            hub, at once (StreamError ``shutdown`` and the engine cancel a ``close()``
            would post), before Cancelled propagates: a caller that stops waiting
            leaves no stream running past the drain it asked for. The loop applies
            those cancels at its next step while ``run`` goes on; where ``run`` is
            cancelled too (the app's nursery at its deadline), they stay unapplied.
        """
        self.drain()
        try:
            await self._stopped.wait()
        except trio.Cancelled:
            self._end_all(ErrorType.SHUTDOWN, "the server is shutting down", StreamEnd.SHUTDOWN)
            raise

    # -- streams -------------------------------------------------------------------

    def open_stream(
        self, request: GenerationRequest, *, policy: PolicyName | None = None,
        resume_from: Sequence[int] = (),
    ) -> TokenStream:
        """Submit ``request`` and open its stream; the engine admits it at a later step.
        ``resume_from``: the tokens it made already (a failover: ``Engine.submit``); its
        stream's events go on after them.

        Returns:
            The stream, registered under ``request.request_id``, using ``policy`` (by
            default the settings'). Its owner must close() it.

        Raises:
            NotAccepting: the hub is not RUNNING.
            WaitingLimitReached: ``max_waiting`` streams wait for their first token.
            DeadlineUnmeetable: the request has a ``ttft_deadline`` and the engine's
                estimate (``estimate_ttft_ms`` of its ``prompt_token_ids``, which it
                should carry) says the first token comes after it. No estimate yet:
                admitted. Past the deadline, the engine lets it go unless its prefill
                has begun (FinishReason.DEADLINE, StreamError ``deadline_missed``).
            engine.InvalidRequest: the engine refused the request (including
                ``DuplicateRequestId``, also for an id still registered here).
            In every case nothing was submitted or registered.
        """
        if self._state is not HubState.RUNNING:
            raise NotAccepting(self._state.value)
        if self._streams.num_waiting() >= self.settings.max_waiting:
            self._refused_waiting += 1
            raise WaitingLimitReached(
                self.settings.max_waiting, self.settings.waiting_retry_after_s
            )
        self.check_deadline(request)
        request_id = request.request_id
        if request_id in self._streams or request_id in self._router.in_engine:
            raise DuplicateRequestId(f"request id {request_id!r} is in use")
        prompt_tokens = self._engine.submit(request, resume_from)
        chosen = self.default_policy if policy is None else self._policy(policy)
        stream = self._stream_type(request_id, prompt_tokens, chosen, self._streams)
        stream.band = request.priority
        self._streams.add(stream)
        self._router.submitted(request_id)
        self._deadlines.submitted(request)
        self._opened += 1
        self._loop.wake()
        return stream

    def finished(self, request_id: str) -> FinishEvent | None:
        """How the engine let ``request_id`` go, if it did so recently (else None).

        The FinishEvent says why (including ``cancelled`` for a client that left),
        how many tokens were made, and when the blocks were released.
        """
        return self._router.finished(request_id)

    def streams(self) -> list[TokenStream]:
        """The open streams, now (a copy). Sync, no checkpoint."""
        return self._streams.all()

    def statistics(self) -> HubStatistics:
        streams = [s.statistics() for s in self._streams.all()]
        return HubStatistics(
            state=self._state,
            streams_open=len(streams),
            waiting=sum(s.state is StreamState.WAITING for s in streams),
            paused_streams=sum(s.is_paused for s in streams),
            engine_requests=len(self._router.in_engine),
            opened=self._opened,
            closes=self._streams.closes,
            refused_waiting=self._refused_waiting,
            refused_deadline=self._deadlines.refused,
            deadline_misses=self._deadlines.misses,
            steps=self._stepper.steps,
            step_errors=self._step_errors,
            last_error=self._last_error,
            events_routed=self._router.routed,
            events_dropped=self._router.dropped,
            slow_client_drops=self._slow_client_drops,
            loop_wait_s=self._stepper.loop_wait_s,
        )

    # -- the hub's own tasks --------------------------------------------------------

    async def _end_at_drain_deadline(self) -> None:
        """Once ``drain()`` was called, wait for its deadline, then end every open
        stream with StreamError ``shutdown``. Returns after that.

        Cancellation: nothing to undo: it only waits, and ends streams only after its
        waits, synchronously. It is cancelled when ``run`` ends, and ``run``'s own way
        out ends whatever is left.
        """
        await self._draining.wait()
        await trio.sleep_until(self._drain_deadline)
        self._end_all(ErrorType.SHUTDOWN, "the server is shutting down", StreamEnd.SHUTDOWN)

    async def _watch_stalls(self) -> None:
        """Drop readers still behind at their stall deadline. Never returns.

        Runs apart from the step loop because that loop sleeps when every sequence is
        paused. Cancellation: nothing to undo: it only sleeps; a drop happens after the
        sleep, synchronously, so a cancel never finds one half done.
        """
        while True:
            with trio.CancelScope(deadline=self._streams.earliest_stall()) as scope:
                self._streams.watch_scope = scope
                await trio.sleep_forever()
            now = trio.current_time()
            for stream in self._streams.all():
                if stream.drop_if_overdue(now):
                    self._slow_client_drops += 1

    # -- helpers -------------------------------------------------------------------

    def _policy(self, name: PolicyName) -> Policy:
        s = self.settings
        return Policy(name, queue_limit=s.queue_limit, stall_timeout_s=s.stall_timeout_s)

    def check_deadline(self, request: GenerationRequest) -> None:
        """Raise DeadlineUnmeetable if the engine's estimate says the first token cannot
        come by ``request.ttft_deadline`` (``TtftDeadlines.check``: sync, never waits a
        step; without ``prompt_token_ids``, a lower bound). ``open_stream`` checks again."""
        self._deadlines.check(request)

    def _keep_stepping(self) -> bool:
        """Whether the step loop goes on: until a drain, and after it while the engine
        holds any of the hub's requests (its cache is not whole yet)."""
        return self._state is HubState.RUNNING or bool(self._router.in_engine)

    def _record_failure(self, exc: Exception) -> None:
        self._state = HubState.FAILED
        self._step_errors += 1
        self._last_error = repr(exc)
        self._end_all(ErrorType.ENGINE_ERROR, f"the engine failed: {exc!r}", StreamEnd.ERROR)

    def _end_all(self, error_type: ErrorType, message: str, end: StreamEnd) -> None:
        for stream in self._streams.all():
            stream.fail(StreamError(error_type, message), end)


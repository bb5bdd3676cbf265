"""Serving the app for real in a test: hypercorn on a loopback port, a tiny engine, checks.

``open_servers(loaded_model)`` yields ``start(**settings)``, which builds the app around a
``RecordingEngine`` (the real engine on a tiny model, recording every event it emits),
serves it with ``hypercorn.trio.serve`` on ``127.0.0.1:0`` (hypercorn reports the bound
address through ``task_status``), and waits until the model is "loaded". Given a
``tls.Certificate``, ``open_servers(loaded_model, certificate)`` serves over TLS with
hypercorn's ``certfile``/``keyfile``, so that the server offers ``h2`` and ``http/1.1`` by
ALPN (the HTTP/2 clients are in ``http2_clients.py``). At the end,
for every server, BEFORE shutting it down (shutdown would tidy up a leak and hide it):
no stream is registered, the engine holds no request and its cache is whole, and it
released exactly the sequences it admitted. Then the server stops and the cache must
still be whole.

The clients the tests use against it are in ``http_clients.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from app.edge import h2_retire
from app.factory import StreamscopeApp, create_app
from app.runtime import Phase, ServingEngine
from app.settings import Settings
from engine import (
    Constraint,
    EngineEvent,
    EngineStatistics,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    TokenEvent,
)
from streams import Hub
from tests.http_clients import RawClient
from tests.tls import Certificate

# Small enough to be quick, large enough for every test here: 64 blocks of 16 positions
# hold any request the tiny models' 512-position context allows.
TEST_SETTINGS = Settings(
    model="tiny-gpt2",
    device="cpu",
    max_batch=4,
    cache_blocks=64,
    block_size=16,
    max_new_tokens_limit=500,
    default_max_new_tokens=8,
    max_body_bytes=4096,
    max_prompt_chars=3000,
)
# Safety nets only: every wait is for a condition; these fire only if it never comes.
SETTLE_TIMEOUT_S = 10.0
POLL_S = 0.005  # between looks at a condition that has no event to wait on
# hypercorn lets open connections finish for this long at shutdown, then cuts them.
GRACEFUL_TIMEOUT_S = 2.0


class RecordingEngine:
    """The engine, recording each event it emits, with a gate that can hold its steps.

    Thread-safe like the engine: ``step`` runs in the hub's worker thread, the rest in
    the Trio thread. ``hold()`` makes the next step wait (in its worker thread) until
    ``release()``; cancels posted meanwhile are applied at that step's start. ``pace(s)``
    makes every step wait ``s`` seconds first: a stream then goes on producing tokens,
    but its n tokens take n * s at least, however fast the machine.
    """

    def __init__(self, engine: ServingEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._gate = threading.Event()
        self._gate.set()
        # Compiles started (namespace, constraint), in order; a gate that can hold them.
        self.compiles: list[tuple[bytes, Constraint]] = []
        self._compile_gate = threading.Event()
        self._compile_gate.set()
        # Worker-thread tokenizer calls ("encode" prompt, "render" last content), in
        # order; a gate that can hold the renders.
        self.tokenizer_calls: list[tuple[str, str]] = []
        self._render_gate = threading.Event()
        self._render_gate.set()
        self._pace_s = 0.0
        self.events: list[EngineEvent] = []
        self.cancel_marks: dict[str, int] = {}  # id -> its tokens emitted at first cancel()
        self.submitted: list[str] = []  # ids the engine accepted, in order
        self._failing: set[str] = set()  # ids whose cancel the engine reports as ERROR
        self._broken_text: set[str] = set()  # ids whose detokenizer is to be broken

    # -- the engine's interface -------------------------------------------------------

    def submit(self, request: GenerationRequest, resume_from: Sequence[int] = ()) -> int:
        prompt_tokens = self._engine.submit(request, resume_from)
        self.submitted.append(request.request_id)
        return prompt_tokens

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancel_marks.setdefault(request_id, self._num_tokens(request_id))
        self._engine.cancel(request_id)

    def pause(self, request_id: str) -> None:
        self._engine.pause(request_id)

    def resume(self, request_id: str) -> None:
        self._engine.resume(request_id)

    def has_work(self) -> bool:
        return self._engine.has_work()

    def estimate_ttft_ms(self, prompt_tokens: int, prompt_ids: Sequence[int] = (),
                         cache_namespace: bytes = b"", priority: int = 0) -> float | None:
        return self._engine.estimate_ttft_ms(prompt_tokens, prompt_ids, cache_namespace,
                                             priority)

    @property
    def max_positions(self) -> int:
        return self._engine.max_positions

    def tokenize(self, prompt: str) -> list[int]:
        with self._lock:
            self.tokenizer_calls.append(("encode", prompt))
        return self._engine.tokenize(prompt)

    def tokenize_if_free(self, prompt: str) -> list[int] | None:
        return self._engine.tokenize_if_free(prompt)

    def compile_constraint(self, constraint: Constraint, namespace: bytes = b"",
                           owner: Hashable = None) -> None:
        with self._lock:
            self.compiles.append((namespace, constraint))
        self._compile_gate.wait()
        self._engine.compile_constraint(constraint, namespace, owner)

    def constraint_cached(self, constraint: Constraint, namespace: bytes = b"") -> bool:
        return self._engine.constraint_cached(constraint, namespace)

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        with self._lock:
            self.tokenizer_calls.append(("render", messages[-1]["content"]))
        self._render_gate.wait()
        return self._engine.render_chat(messages, add_generation_prompt, tools)

    def chat_template_uses(self, name: str) -> bool:
        return self._engine.chat_template_uses(name)

    def statistics(self) -> EngineStatistics:
        return self._engine.statistics()

    def step(self, on_prefill: Callable[[list[EngineEvent]], None] | None = None) -> list[Any]:
        self._gate.wait()
        if self._pace_s:
            time.sleep(self._pace_s)  # in the worker thread: the event loop runs on
        self._break_text()

        def record_prefill(events: list[EngineEvent]) -> None:
            events = [self._as_failure(e) for e in events]  # cancel finishes come here too
            self._record(events)
            assert on_prefill is not None
            on_prefill(events)

        events = self._engine.step(on_prefill=record_prefill if on_prefill else None)
        events = [self._as_failure(e) for e in events]
        self._record(events)
        return events

    # -- for tests --------------------------------------------------------------------

    def fail(self, request_id: str) -> None:
        """Make the engine fail this request at its next step, as a failed forward pass
        would: the sequence is released and its FinishEvent says ERROR."""
        with self._lock:
            self._failing.add(request_id)
        self._engine.cancel(request_id)

    def break_text(self, request_id: str) -> None:
        """Fault injection: from its next token on, this request's detokenizer raises.
        Applied in the stepping thread at the start of a step, once the engine holds
        the request (its Sequence object gets a detokenizer that always raises)."""
        with self._lock:
            self._broken_text.add(request_id)

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def hold_compiles(self) -> None:
        """From now on, each constraint's compile waits (in its worker thread) until
        ``release_compiles``."""
        self._compile_gate.clear()

    def release_compiles(self) -> None:
        self._compile_gate.set()

    def hold_renders(self) -> None:
        """From now on, each chat render waits (in its worker thread) until
        ``release_renders``."""
        self._render_gate.clear()

    def release_renders(self) -> None:
        self._render_gate.set()

    def pace(self, step_s: float) -> None:
        """From the next step on, each waits ``step_s`` before it runs (0: full speed)."""
        self._pace_s = step_s

    def finish_of(self, request_id: str) -> FinishEvent | None:
        with self._lock:
            return next((e for e in self.events if isinstance(e, FinishEvent)
                         and e.request_id == request_id), None)

    def token_ids_of(self, request_id: str) -> list[int]:
        with self._lock:
            return [e.token_id for e in self.events
                    if isinstance(e, TokenEvent) and e.request_id == request_id]

    def admitted(self) -> set[str]:
        """Ids the engine admitted: a prefill always yields a token, or fails (ERROR)."""
        with self._lock:
            return {e.request_id for e in self.events if isinstance(e, TokenEvent)
                    or (isinstance(e, FinishEvent) and e.reason is FinishReason.ERROR)}

    def _as_failure(self, event: EngineEvent) -> EngineEvent:
        with self._lock:
            failing = event.request_id in self._failing
        if failing and isinstance(event, FinishEvent) and event.reason is FinishReason.CANCELLED:
            return replace(event, reason=FinishReason.ERROR, error="scripted failure")
        return event

    def _break_text(self) -> None:
        from engine.engine import Engine  # tests may use engine internals; app may not

        with self._lock:
            pending = list(self._broken_text)
        assert not pending or isinstance(self._engine, Engine)
        for request_id in pending:
            seq = self._engine.scheduler.find(request_id)  # type: ignore[attr-defined]
            if seq is not None:  # else still in the inbox: next step
                seq.detokenizer = _BrokenDetokenizer()
                with self._lock:
                    self._broken_text.discard(request_id)

    def _record(self, events: list[EngineEvent]) -> None:
        with self._lock:
            self.events.extend(events)

    def _num_tokens(self, request_id: str) -> int:
        return sum(isinstance(e, TokenEvent) and e.request_id == request_id for e in self.events)


class _BrokenDetokenizer:
    """What ``RecordingEngine.break_text`` puts in a Sequence: every call raises."""

    def add(self, token_id: int) -> str:
        raise UnicodeDecodeError("utf-8", bytes([token_id % 256]), 0, 1, "injected text fault")

    def flush(self) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected text fault")


@dataclass
class RunningServer:
    """One app served on a loopback port, with handles on its engine and hub."""

    app: StreamscopeApp
    base_url: str
    host: str
    port: int
    _stop: trio.Event = field(default_factory=trio.Event)
    _stopped: trio.Event = field(default_factory=trio.Event)

    @property
    def hub(self) -> Hub:
        hub = self.app.runtime.hub
        assert hub is not None, "the hub is not running"
        return hub

    @property
    def engine(self) -> RecordingEngine | None:
        """The engine, once built (None before, or if a test built another kind)."""
        engine = self.app.runtime.engine
        return engine if isinstance(engine, RecordingEngine) else None

    @property
    def recorder(self) -> RecordingEngine:
        assert self.engine is not None, "the engine was not built"
        return self.engine

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=SETTLE_TIMEOUT_S, **kwargs)

    def raw_client(self) -> RawClient:
        return RawClient(self.host, self.port)

    def stop(self) -> None:
        """Trigger hypercorn's graceful shutdown (returns at once)."""
        self._stop.set()

    async def wait_stopped(self) -> None:
        with trio.fail_after(SETTLE_TIMEOUT_S + GRACEFUL_TIMEOUT_S):
            await self._stopped.wait()

    async def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        """Poll ``condition`` until true; fail with ``what`` after SETTLE_TIMEOUT_S."""
        try:
            with trio.fail_after(SETTLE_TIMEOUT_S):
                # The engine's and hub's counters come with no event to wait on.
                while not condition():  # noqa: ASYNC110
                    await trio.sleep(POLL_S)
        except trio.TooSlowError:
            raise AssertionError(f"timed out waiting for {what}") from None

    async def wait_finished(self, request_id: str) -> FinishEvent:
        await self.wait_for(lambda: self.recorder.finish_of(request_id) is not None,
                            f"the engine to finish {request_id}")
        finish = self.recorder.finish_of(request_id)
        assert finish is not None
        return finish

    async def assert_settled(self) -> None:
        """No stream registered, nothing in the engine, cache whole, releases == admitted."""
        if self.engine is None or self.app.runtime.hub is None:
            return
        self.engine.release()
        self.engine.pace(0)
        engine = self.engine

        def settled() -> bool:
            hub, stats = self.hub.statistics(), engine.statistics()
            return (hub.streams_open, hub.engine_requests, stats.running, stats.waiting,
                    stats.blocks_free) == (0, 0, 0, 0, stats.blocks_total)

        try:
            await self.wait_for(settled, "streams closed and the cache whole")
        except AssertionError:
            raise AssertionError(f"not settled: {self.hub.statistics()} "
                                 f"{engine.statistics()}") from None
        stats = engine.statistics()
        if stats.preemptions:  # a preempted sequence's readmission takes a new table
            assert stats.releases == stats.admitted >= len(engine.admitted())
        else:
            assert stats.releases == len(engine.admitted())


async def _serve_one(
    app: StreamscopeApp, config: Config, stop: trio.Event, stopped: trio.Event,
    *, task_status: trio.TaskStatus[list[str]],
) -> None:
    try:
        await serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
    finally:
        stopped.set()


StartServer = Callable[..., Awaitable[RunningServer]]


@asynccontextmanager
async def open_servers(
    loaded_model: Any, certificate: Certificate | None = None
) -> AsyncIterator[StartServer]:
    """Yield ``start(**options, **settings)``, which serves a new app and returns it.

    With ``certificate``, every server is served over TLS with it (``https://``).
    Options: ``make_engine`` (default: a RecordingEngine on ``loaded_model``, the tiny
    model's shared ``LoadedModel``), ``create`` (default ``create_app``; the lab's tests
    pass ``tools.lab._app.create_lab_app``), ``load_gate`` (a threading.Event the load waits
    for), ``graceful_timeout_s`` (hypercorn's), ``wait_ready`` (default True),
    ``goaway_on_drain`` (start ``h2_retire.goaway_on_drain`` beside the server, as
    ``streamscope serve`` does), ``hypercorn`` (more of hypercorn's settings, by name).
    """
    from engine.engine import Engine  # tests may use engine internals; app may not

    servers: list[RunningServer] = []
    failures: list[BaseException] = []

    def default_engine(settings: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded_model, max_batch=settings.max_batch,
                                      num_blocks=settings.cache_blocks,
                                      block_size=settings.block_size))

    async with trio.open_nursery() as nursery:

        async def start(
            *,
            make_engine: Callable[[Settings], ServingEngine] | None = None,
            create: Callable[..., StreamscopeApp] = create_app,
            load_gate: threading.Event | None = None,
            graceful_timeout_s: float = GRACEFUL_TIMEOUT_S,
            wait_ready: bool = True,
            goaway_on_drain: bool = False,
            hypercorn: dict[str, Any] | None = None,
            **overrides: Any,
        ) -> RunningServer:
            settings = TEST_SETTINGS.replace(**overrides)

            def build(s: Settings) -> ServingEngine:
                if load_gate is not None:
                    load_gate.wait()
                return (make_engine or default_engine)(s)

            app = create(settings, make_engine=build)
            config = Config()
            config.bind = ["127.0.0.1:0"]
            config.graceful_timeout = graceful_timeout_s
            if certificate is not None:
                config.certfile, config.keyfile = str(certificate.cert), str(certificate.key)
            for name, value in (hypercorn or {}).items():
                setattr(config, name, value)
            stop, stopped = trio.Event(), trio.Event()
            binds = await nursery.start(_serve_one, app, config, stop, stopped)
            base_url = binds[0]
            host, port = base_url.split("://", 1)[1].rsplit(":", 1)
            server = RunningServer(app, base_url, host, int(port), stop, stopped)
            servers.append(server)
            if goaway_on_drain:
                nursery.start_soon(h2_retire.goaway_on_drain, app.runtime, config)
            if wait_ready:
                with trio.fail_after(SETTLE_TIMEOUT_S):
                    phase = await app.runtime.loading_outcome()
                assert phase is Phase.READY, app.runtime.failure
            return server

        yield start

        for server in servers:
            if server.engine is not None:
                server.engine.release()  # a test that failed may have left it held
                server.engine.pace(0)  # or paced
        for server in servers:
            try:
                if not server._stop.is_set():
                    await server.assert_settled()
            except Exception as exc:  # reported after every server stopped
                failures.append(exc)
            server.stop()
            try:
                await server.wait_stopped()
            except trio.TooSlowError:
                failures.append(AssertionError("the server did not stop"))
                nursery.cancel_scope.cancel(reason="a server did not stop")
                break
            if server.engine is not None:
                stats = server.engine.statistics()
                if stats.blocks_free != stats.blocks_total:
                    failures.append(AssertionError(f"cache not whole after shutdown: {stats}"))
        nursery.cancel_scope.cancel(reason="the servers have stopped")  # goaway_on_drain's
    if failures:
        raise failures[0]

"""The same engine behind uvicorn and Starlette's ``StreamingResponse``: the plain asyncio
way to serve it, for ``tools.servicebench`` to compare our serving path with.

::

    STARLETTE_PEER_ENGINE=simulated python -m uvicorn tools.peers.uvicorn_starlette:create_app \\
        --factory --host 127.0.0.1 --port 0

Why: the serving path's cost is only meaningful beside another serving path over the same
engine. This is the one a reader would write first: the engine's step loop in a thread of
its own, which steps whenever there is work and hands each step's events to the event
loop in one ``loop.call_soon_threadsafe`` (a prefill's as soon as its pass is done,
through ``on_prefill``, as our hub does), where they go into per-request
``asyncio.Queue`` objects; each ``POST /v1/stream`` is a ``StreamingResponse`` over an
async generator that reads its queue and yields the same SSE events as our
``/v1/stream`` (``start``, ``token``, ``done``; the bytes come from ``app.wire``'s
own encoders), so the same client counts both. The body fields are the ones our route
takes (``prompt``, ``max_new_tokens``, ``ignore_eos``; greedy). It has none of the
service's guards (slow-reader policies, limits, drain): a queue grows without bound for
a reader that does not read, which a fast benchmark client never is.

Settings (environment, read by ``create_app``): ``STARLETTE_PEER_ENGINE`` (``tiny``:
``STARLETTE_PEER_MODEL``, default tiny-gpt2, as the service loads it; ``simulated``:
``tools/simulated.py``'s runner at ``STARLETTE_PEER_SIM_STEP_MS``),
``STARLETTE_PEER_MAX_BATCH`` (default 32). The engine is built at startup in a worker
thread, then every object alive is frozen out of the garbage collector's reach, as our
lifespan does (``app/runtime/loading.py``'s ``build_and_freeze``). ``GET /ready`` answers once
it runs; ``GET /stats`` is the engine's statistics (the same fields as ours).
Importing ``app.wire`` imports the ``app`` package, which builds nothing (the
service's app is built on first access to ``app.app``, never here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.settings import Settings
from app.wire import encode_json_event, item_event, start_event
from engine import (
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
)
from engine.engine import Engine

PREFIX = "STARLETTE_PEER_"
DEFAULT_MAX_NEW_TOKENS = 64  # our STREAMSCOPE_DEFAULT_MAX_NEW_TOKENS's default
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # as app/routes/serving.py


def build_engine(environ: dict[str, str]) -> Engine:
    """The engine the ``STARLETTE_PEER_*`` variables name (see the module docstring)."""
    from engine import load_engine

    kind = environ.get(PREFIX + "ENGINE", "tiny")
    model = environ.get(PREFIX + "MODEL", "tiny-gpt2")
    max_batch = int(environ.get(PREFIX + "MAX_BATCH", "32"))
    # The same engine as ours, prefix cache as our default (tools.servicebench compares).
    prefix_cache = Settings().prefix_cache
    if kind == "tiny":
        return load_engine(model, "cpu", max_batch=max_batch, prefix_cache=prefix_cache)
    if kind == "simulated":
        from engine.model import load_model
        from tools.simulated import DEFAULT_STEP_MS, simulated_engine

        step_ms = float(environ.get(PREFIX + "SIM_STEP_MS", DEFAULT_STEP_MS))
        return simulated_engine(load_model(model, "cpu"), step_ms=step_ms, max_batch=max_batch,
                                prefix_cache=prefix_cache)
    raise ValueError(f"{PREFIX}ENGINE={kind!r}: expected tiny or simulated")


class EngineLoop:
    """The engine's step loop in a thread, events to per-request asyncio queues."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._queues: dict[str, asyncio.Queue[EngineEvent]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def open(self, request: GenerationRequest) -> tuple[int, asyncio.Queue[EngineEvent]]:
        """Submit ``request``; its prompt's token count and the queue of its events.

        Raises: engine.InvalidRequest (nothing was submitted)."""
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        prompt_tokens = self.engine.submit(request)
        self._queues[request.request_id] = queue
        self._wake.set()
        return prompt_tokens, queue

    def close(self, request_id: str, *, finished: bool) -> None:
        """Forget the request; cancel it in the engine unless it ``finished`` (a cancel
        is a wish the engine would take a step to apply)."""
        if self._queues.pop(request_id, None) is not None and not finished:
            self.engine.cancel(request_id)
            self._wake.set()

    def _run(self) -> None:
        """Step while there is work, else sleep until a submit or cancel wakes us."""
        _name_os_thread(self._thread.name)
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                events = self.engine.step(on_prefill=self._hand_over)
            except Exception as exc:  # the engine is broken: end every stream, stop
                self._loop.call_soon_threadsafe(self._fail_all, repr(exc))
                raise
            self._hand_over(events)

    def _hand_over(self, events: list[EngineEvent]) -> None:
        if events:
            self._loop.call_soon_threadsafe(self._route, events)

    def _fail_all(self, error: str) -> None:
        """In the loop: a last ``done`` with reason ``error`` for every open stream."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(FinishEvent(request_id, FinishReason.ERROR, 0, 0, error))

    def _route(self, events: list[EngineEvent]) -> None:
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)


def _name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in ``/proc/<pid>/task/<tid>/comm`` too (Linux;
    Python 3.11 names only its own object), as Trio names its worker threads."""
    import ctypes

    pr_set_name = 15
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


async def sse_events(engine_loop: EngineLoop, request_id: str, prompt_tokens: int,
                     queue: asyncio.Queue[EngineEvent]) -> AsyncIterator[bytes]:
    """One stream's SSE bytes, an event at a time, as our ``/v1/stream`` writes them;
    on every way out the request is forgotten (and cancelled unless it finished)."""
    item: EngineEvent | None = None
    try:
        name, data = start_event(request_id, prompt_tokens)
        yield encode_json_event(name, 1, data)
        event_id = 2
        while not isinstance(item, FinishEvent):
            item = await queue.get()
            name, data = item_event(item)
            yield encode_json_event(name, event_id, data)
            event_id += 1
    finally:
        engine_loop.close(request_id, finished=isinstance(item, FinishEvent))


def create_app() -> Starlette:
    """The peer's ASGI app (uvicorn ``--factory``), settings from the environment."""
    state: dict[str, EngineLoop] = {}

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        engine = await asyncio.to_thread(build_engine, dict(os.environ))
        gc.collect()
        gc.freeze()
        state["loop"] = EngineLoop(engine, asyncio.get_running_loop())
        state["loop"].start()
        yield
        state["loop"].stop()

    async def stream(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        generation = GenerationRequest(
            uuid.uuid4().hex, body["prompt"],
            body.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS,
            sampling=SamplingParams(ignore_eos=bool(body.get("ignore_eos", False))))
        try:
            prompt_tokens, queue = state["loop"].open(generation)
        except InvalidRequest as exc:
            return JSONResponse({"error": {"type": "invalid_request", "message": str(exc)}},
                                status_code=422)
        events = sse_events(state["loop"], generation.request_id, prompt_tokens, queue)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={**SSE_HEADERS, "X-Request-ID": generation.request_id})

    async def ready(_: Request) -> Response:
        return JSONResponse({"status": "ready"})

    async def stats(_: Request) -> Response:
        with suppress(KeyError):
            return JSONResponse(dataclasses.asdict(state["loop"].engine.statistics()))
        return JSONResponse({}, status_code=503)

    return Starlette(lifespan=lifespan, routes=[
        Route("/v1/stream", stream, methods=["POST"]),
        Route("/ready", ready), Route("/health", ready), Route("/stats", stats),
    ])

"""Every stop signal the server heeds, and how hypercorn stops after the drain.

The drain itself is ``Runtime.drain()`` (``app/runtime``) and ``Hub.drain()`` below it:
synchronous and idempotent, so any signal source may call it. This module holds every
source the server's own commands use:

- under ``hypercorn -k trio app:app``, ``watch_for_stop`` (``create_app(drain_on_sigterm=
  True)`` starts it in the app's nursery): SIGTERM, or hypercorn's own stop (below);
- under ``streamscope serve`` (``cli.py``), ``drain_on_signals``: SIGTERM or SIGINT, with
  ``Runtime.wait_drained`` as hypercorn's ``shutdown_trigger``.

A program that serves the app itself with ``hypercorn.trio.serve`` watches its own
signals instead: it calls ``app.runtime.drain(...)`` and passes
``app.runtime.wait_drained`` as ``shutdown_trigger``.

How hypercorn 0.18 stops (read from ``hypercorn/run.py`` and ``hypercorn/trio/run.py``):

- ``hypercorn -k trio app:app`` serves from ONE spawned worker process (``--workers``
  defaults to 1; only ``--workers 0`` serves in the main process). The main process
  handles SIGINT and SIGTERM: its handler sets a ``multiprocessing`` Event that the
  worker polls every 0.1 s. The worker inherits SIGINT ignored and has no SIGTERM
  handler of its own, so a SIGTERM that reaches it (sent to its pid, or to the process
  group as systemd does) would kill it at once.
- Once the worker sees that Event it stops accepting (new connections wait unanswered in
  the listen backlog until the process exits), closes idle keep-alive connections and
  reuses none, lets open connections run for ``--graceful-timeout`` (3 s by default),
  cancels the rest, and only then runs the ASGI lifespan shutdown (``after_serving``).
  The main process exits with the worker's exit code; a worker that exits while the main
  process was not signalled is started again.

So the app learns of a stop in one of two ways, whichever comes first, and each calls
``runtime.drain()`` at once:

1. SIGTERM to the app's own process (``trio.open_signal_receiver``). hypercorn has not
   been told: it keeps accepting, so new requests get 503 ``shutdown`` with
   ``Retry-After`` and ``/ready`` says 503 while the open streams finish. After the
   drain the app sends SIGTERM to hypercorn's main process, which stops the worker as
   above (only idle connections and last events being written are left) and exits 0.
   With ``--workers 0`` there is no main process to tell: the app then raises SIGINT in
   its own process, which Trio delivers to hypercorn as the KeyboardInterrupt of a
   Ctrl-C, hypercorn's graceful stop there.
2. hypercorn's shutdown Event (SIGTERM or SIGINT to hypercorn's main process: ``docker
   stop``, Kubernetes): the drain starts within ``HYPERCORN_POLL_S`` of the signal,
   together with hypercorn's graceful timeout. hypercorn no longer accepts, so new
   clients get no answer at all; the open streams finish, or get ``error: shutdown`` at
   the drain deadline, before hypercorn would cut them, provided ``--graceful-timeout``
   is at least ``STREAMSCOPE_SHUTDOWN_GRACE_S`` + ``DRAIN_MARGIN_S`` (the app warns at
   startup if not). hypercorn passes the Event to its worker function only; the app
   reads it from the worker's ``multiprocessing`` process object, where hypercorn 0.18
   put it (``_kwargs``, a private attribute: tests/test_app_drain.py checks it). Drop
   this source when hypercorn tells applications of a shutdown itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ..runtime import Runtime

log = logging.getLogger("streamscope.app")

# hypercorn's own poll of its shutdown Event (hypercorn/utils.py, 0.1 s); the same here.
HYPERCORN_POLL_S = 0.1
# After the drain deadline: the last events go out and the engine applies the cancels
# (a step or two). hypercorn's graceful timeout must cover the deadline and this.
DRAIN_MARGIN_S = 1.0


class _Event(Protocol):
    def is_set(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class HypercornWorker:
    """This process as hypercorn's command-line worker: its main process's stop Event."""

    shutdown_event: _Event
    graceful_timeout_s: float
    main_pid: int  # hypercorn's main process, which spawned this one


def hypercorn_worker() -> HypercornWorker | None:
    """This process as hypercorn 0.18's spawned CLI worker, or None (``--workers 0``,
    ``hypercorn.trio.serve``, or another hypercorn version that passes other arguments)."""
    kwargs: Any = getattr(multiprocessing.current_process(), "_kwargs", None)
    parent = multiprocessing.parent_process()
    if not isinstance(kwargs, dict) or parent is None or parent.pid is None:
        return None
    event: Any = kwargs.get("shutdown_event")
    config: Any = kwargs.get("config")
    timeout = getattr(config, "graceful_timeout", None)
    if not callable(getattr(event, "is_set", None)) or not isinstance(timeout, int | float):
        return None
    return HypercornWorker(event, float(timeout), parent.pid)


async def watch_for_stop(runtime: Runtime) -> None:
    """Drain at the first SIGTERM or hypercorn stop (see the module docstring); after a
    drain that SIGTERM began, tell hypercorn to stop. Runs until cancelled; further
    SIGTERMs are only logged, so they cannot kill the worker during hypercorn's stop.

    Cancellation: nothing to undo (the app's nursery, at shutdown): the previous SIGTERM
    handler is back, and a drain in progress goes on in the hub, bounded by its own
    deadline.
    """
    worker = hypercorn_worker()
    if worker is not None:
        needed = runtime.settings.shutdown_grace_s + DRAIN_MARGIN_S
        if worker.graceful_timeout_s < needed:
            log.warning("hypercorn's --graceful-timeout (%.1f s) is shorter than "
                        "STREAMSCOPE_SHUTDOWN_GRACE_S + %.1f s: a SIGTERM to hypercorn's "
                        "main process cuts streams before the drain deadline; use "
                        "--graceful-timeout %.0f or more", worker.graceful_timeout_s,
                        DRAIN_MARGIN_S, needed)
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        by_signal = await _first_stop(signals, worker)
        runtime.drain("SIGTERM" if by_signal else "hypercorn is stopping")
        await runtime.wait_drained()
        if by_signal:
            _stop_hypercorn(worker)
        async for signum in signals:
            log.warning("%s again: the server is already stopping", signal.Signals(signum).name)


async def drain_on_signals(
    runtime: Runtime, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """``streamscope serve``'s stop: drain at the first SIGTERM or SIGINT, log the others
    (the drain has a deadline of its own). Started (``nursery.start``) once the handlers
    are in place; runs until cancelled.

    Cancellation: nothing to undo: the previous handlers are back, and a drain in
    progress goes on, bounded by its own deadline.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        first = True
        async for signum in signals:
            name = signal.Signals(signum).name
            if first:
                runtime.drain(name)
                first = False
            else:
                log.warning("%s again: the server is already stopping", name)


async def _first_stop(signals: AsyncIterator[int], worker: HypercornWorker | None) -> bool:
    """Wait for SIGTERM (True) or hypercorn's stop Event (False), whichever is first.

    Cancellation: nothing to undo: it only waits; its nursery's watchers end with it,
    and no drain was started.
    """
    by_signal = False
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            """The first SIGTERM ends the wait. Cancellation: nothing to undo: a
            signal not taken yet stays queued in the receiver."""
            nonlocal by_signal
            await signals.__anext__()
            by_signal = True
            nursery.cancel_scope.cancel(reason="SIGTERM")

        async def on_hypercorn_stop(event: _Event) -> None:
            """hypercorn's stop Event ends the wait (a multiprocessing Event has no async
            wait; hypercorn polls it the same way). Cancellation: nothing to undo: it only
            polls."""
            while not event.is_set():  # noqa: ASYNC110
                await trio.sleep(HYPERCORN_POLL_S)
            nursery.cancel_scope.cancel(reason="hypercorn is stopping")

        nursery.start_soon(on_signal)
        if worker is not None:
            nursery.start_soon(on_hypercorn_stop, worker.shutdown_event)
    return by_signal


@trio.lowlevel.enable_ki_protection
def _stop_hypercorn(worker: HypercornWorker | None) -> None:
    """Ask hypercorn for its graceful stop, as an operator would (see the docstring)."""
    if worker is not None:
        # Only while hypercorn's main process is still our parent: had it died, this
        # process would have been reparented (to a container's init, say).
        if not worker.shutdown_event.is_set() and os.getppid() == worker.main_pid:
            os.kill(worker.main_pid, signal.SIGTERM)
        return
    # --workers 0: Trio's handler turns SIGINT into KeyboardInterrupt; raised here, in
    # protected code, Trio delivers it to the main task: hypercorn's serve loop, which
    # takes it as its graceful stop (a Ctrl-C).
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        signal.raise_signal(signal.SIGINT)
        return
    log.warning("drained; nothing handles SIGINT here to stop hypercorn: the process ends "
                "as SIGTERM would have ended it")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)

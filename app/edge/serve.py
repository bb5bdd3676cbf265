"""Serving under hypercorn's Trio worker, with defaults for this job: what ``streamscope
serve`` (``app/cli.py``, which builds the app and reads the options) runs.

The same app as ``hypercorn -k trio app:app`` (``create_app``, the ``STREAMSCOPE_*``
settings from the environment, ``hypercorn_patches`` installed as it is built), served in this
process by ``hypercorn.trio.serve``. Why a command of our own: hypercorn's defaults
are a web server's, and one of them loses clients here. Its listen backlog of 100 is
what a burst of clients opening streams at the same moment overflows: of 1,000 clients at
once against ``hypercorn -k trio app:app``, 464-564 got a connection reset from the kernel
and no HTTP answer; none under this command (docs/results.md, "A burst of 1,000
clients"). The defaults below (``serving_defaults``)
each say why; a ``--config`` file (hypercorn's own TOML or Python format, any setting
hypercorn has) overrides them, and ``--bind`` overrides the file's ``bind``.

Stopping: SIGTERM or SIGINT (Ctrl-C) starts the same drain as under the hypercorn CLI
(``Runtime.drain``: new requests get 503 ``shutdown`` with ``Retry-After`` while the open
streams finish, until ``STREAMSCOPE_SHUTDOWN_GRACE_S``); hypercorn keeps accepting and
answering meanwhile. ``Runtime.wait_drained`` is hypercorn's ``shutdown_trigger``: once
the engine holds none of our requests, hypercorn stops accepting, closes the idle
connections, and the process exits 0. A second signal during the drain is only logged,
as under the CLI: the drain has a deadline of its own (``signals.drain_on_signals``).

TLS and HTTP/2: with ``--certfile`` and ``--keyfile`` (or hypercorn's ``certfile`` and
``keyfile`` in the ``--config`` file; the options win) every bind serves TLS and offers
``h2`` and ``http/1.1`` by ALPN (hypercorn's ``alpn_protocols``). Without them the server
speaks HTTP/1.1 and, to a client that asks (prior knowledge, ``h2c``), HTTP/2 in the
clear. Each HTTP/2 connection is ``h2_protocol.GuardedH2Protocol``: per-stream backpressure,
flood budgets (rapid reset), and a GOAWAY when the drain begins (``goaway_on_drain``,
started here beside hypercorn): its clients open no new stream on it, and the streams
running on it finish, or get the drain's last event, as over HTTP/1.1.

No ``--workers``: one process holds one model (its weights, its KV cache, its engine
thread); hypercorn's workers would each load their own and share nothing, not even the
admission limits. Several replicas behind a balancer are the scale-out's job.

Why apart from the command: this module is the edge's (it alone here knows hypercorn),
and it takes a built app; building it is the composition root's (``app/factory.py``),
which the command, beside it, calls. So the edge never imports the root.
"""

from __future__ import annotations

import logging
import resource
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import hypercorn.trio
import trio
from hypercorn.config import Config

from ..quart_app import StreamscopeApp
from ..runtime import Phase, Runtime
from ..settings import Settings
from .h2_retire import goaway_on_drain
from .signals import DRAIN_MARGIN_S, drain_on_signals

log = logging.getLogger("streamscope.app")

DEFAULT_BIND = "127.0.0.1:8000"  # hypercorn's; a public address is the operator's choice
# The listen backlog: connections the kernel completes and holds until the server
# accepts them. A burst of clients opening streams at once arrives faster than one
# event loop accepts; past the backlog the kernel drops their packets (the clients wait for
# retransmits) or resets them (a SYN-cookie connection whose first segment it dropped), and
# those clients get no HTTP answer at all, not even a 429. 2048 is uvicorn's and gunicorn's default;
# Linux caps it at net.core.somaxconn (4096 since 5.4): the server warns when that is less.
LISTEN_BACKLOG = 2048
# h11's limit on an incomplete event: a request head (request line and headers) still
# being received. A head still incomplete past it gets 431 (Request Header Fields Too
# Large) and the connection closes, so it bounds what a client that never finishes its
# head makes us hold, and the size of a head that arrives in pieces. (h11 checks it only
# while a head is incomplete: one that arrives whole in one read, up to hypercorn's
# 64 KiB, passes.) Our largest heads (a bearer key, a cookie, a proxy's forwarding
# headers) are under 4 KiB; 16 KiB (h11's own default) leaves room, and 2,048 half-sent
# heads then hold 32 MiB at most. How long a head may take is keep_alive_timeout's to
# bound (below).
H11_MAX_INCOMPLETE_BYTES = 16 * 1024
# The soft limit on open files below which the server warns: each connection is a file,
# and a full backlog is LISTEN_BACKLOG of them besides the open streams.
ENOUGH_OPEN_FILES = 2 * LISTEN_BACKLOG


class ServeError(Exception):
    """The command cannot start as asked; the message says why (exit status 2)."""


def serving_defaults(settings: Settings) -> dict[str, Any]:
    """hypercorn settings that differ from hypercorn's defaults, for this job."""
    return {
        "backlog": LISTEN_BACKLOG,
        # hypercorn cuts the connections still open this long after it starts to stop.
        # Under this command it starts only after the drain, so the streams are over by
        # then; but a stop hypercorn starts itself (max_requests) would give open
        # streams this long, which must cover the drain deadline and its last steps
        # (hypercorn's default, 3 s, is shorter than the default grace of 5 s).
        "graceful_timeout": settings.shutdown_grace_s + DRAIN_MARGIN_S,
        # How long a connection with no request in flight stays open: before its first
        # request head is complete, and between requests. The SSE keep-alive interval is
        # the server's measure of a silence that is still normal on a connection, so an
        # idle one gets as long: long enough for an SDK client, a proxy's pool or a
        # resuming EventSource to reuse it (hypercorn's 5 s drops many of them), short
        # enough that a client trickling a head (slowloris) holds a file only that long.
        # A streaming response never meets this timer: hypercorn stops it while a
        # request is in flight, and the SSE comments keep intermediaries' timers off.
        "keep_alive_timeout": settings.keepalive_s,
        # None (hypercorn's default, kept on purpose): hypercorn's read timeout runs
        # during a response too, and a stream's client sends nothing while it reads, so
        # any finite value would cut every stream longer than it. Idle and half-sent
        # heads are bounded by keep_alive_timeout above instead.
        "read_timeout": None,
        "h11_max_incomplete_size": H11_MAX_INCOMPLETE_BYTES,
        "worker_class": "trio",  # what serves here, whatever a config file says
    }


def make_config(
    settings: Settings,
    config_file: Path | None = None,
    binds: Sequence[str] = (),
    *,
    certfile: Path | None = None,
    keyfile: Path | None = None,
) -> Config:
    """hypercorn's ``Config``: ``serving_defaults``, then ``config_file`` (TOML, or Python
    if it ends in ``.py``, read by hypercorn's ``from_toml``/``from_pyfile``), then
    ``binds``, ``certfile`` and ``keyfile``.

    Raises:
        ServeError: the file cannot be read, it asks for more than one worker, or TLS is
            half configured or its certificate and key cannot be loaded.
    """
    # A subclass whose class attributes are our defaults: hypercorn's loaders build
    # ``cls()`` and set only what the file has, so the file overrides exactly those.
    layered = cast(type[Config], type("StreamscopeConfig", (Config,), serving_defaults(settings)))
    if config_file is None:
        config = layered()
    else:
        try:
            if config_file.suffix == ".py":
                config = layered.from_pyfile(config_file)
            else:
                config = layered.from_toml(config_file)
        except Exception as exc:
            raise ServeError(f"--config {config_file}: {exc}") from exc
        unknown = sorted(k for k in vars(config) if not hasattr(Config, k))
        if unknown:
            log.warning("--config %s: not hypercorn settings, ignored: %s", config_file,
                        ", ".join(unknown))
    if config.workers != 1:
        raise ServeError(f"workers = {config.workers}: streamscope serve runs one process, "
                         "which holds one model; run several servers for more")
    if binds:
        config.bind = list(binds)
    if certfile is not None:
        config.certfile = str(certfile)
    if keyfile is not None:
        config.keyfile = str(keyfile)
    _check_tls(config)
    _warn_about(config, settings)
    return config


def _check_tls(config: Config) -> None:
    """Refuse half a TLS setup (hypercorn would serve plain HTTP without a word) and a
    certificate or key that cannot be loaded (hypercorn would fail only once serving)."""
    if (config.certfile is None) != (config.keyfile is None):
        have, missing = (("certfile", "keyfile") if config.keyfile is None
                         else ("keyfile", "certfile"))
        raise ServeError(f"TLS needs both a certfile and a keyfile: {have} is set, "
                         f"{missing} is not (--{missing} FILE, or {missing} in --config)")
    if config.ssl_enabled:
        try:
            config.create_ssl_context()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise ServeError(f"TLS: cannot load certfile {config.certfile} with keyfile "
                             f"{config.keyfile}: {exc}") from exc


def _warn_about(config: Config, settings: Settings) -> None:
    needed = settings.shutdown_grace_s + DRAIN_MARGIN_S
    if config.graceful_timeout < needed:
        log.warning("graceful_timeout (%.1f s) is shorter than STREAMSCOPE_SHUTDOWN_GRACE_S "
                    "+ %.1f s: a stop that hypercorn starts may cut streams before the drain "
                    "deadline", config.graceful_timeout, DRAIN_MARGIN_S)
    if config.read_timeout is not None:
        log.warning("read_timeout = %s: a stream whose client sends nothing for that long "
                    "is cut (a stream's client sends nothing while it reads)",
                    config.read_timeout)
    somaxconn = _read_int(Path("/proc/sys/net/core/somaxconn"))
    if somaxconn is not None and somaxconn < config.backlog:
        log.warning("the kernel caps the listen backlog at net.core.somaxconn = %d (asked: "
                    "%d); raise it (sysctl) for bursts of clients", somaxconn, config.backlog)


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (each connection
    is a file; many systems start with a soft limit of 1,024); return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < ENOUGH_OPEN_FILES:
        log.warning("open files are limited to %d (ulimit -n): a connection is a file, so "
                    "a burst of clients may be refused at accept", soft)
    return soft


async def serve(
    app: StreamscopeApp,
    config: Config,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until a SIGTERM or SIGINT has drained it (see the module docstring).

    ``task_status`` gets the addresses hypercorn listens on.

    Cancellation: closed by its owner, with no drain: a cancel from outside is a stop
    that waits for nothing (the drain is the signals' way: the module docstring). hypercorn is
    cancelled as a whole (``_serve_then_stop``): each connection's task closes the
    streams its request opened (``StreamingConnection.__call__``), and the app's
    nursery (in hypercorn's lifespan task) is cancelled with it, so the hub ends the rest
    with StreamError ``shutdown`` and steps no more (``Hub.run``): those cancels stay
    unapplied, as the engine ends with the server. The signal handlers are
    back as ``drain_on_signals``'s receiver exits (synchronously); bound: each task's
    next checkpoint, or a step in flight (finished first).
    """
    async with trio.open_nursery() as nursery:
        await nursery.start(drain_on_signals, app.runtime)
        nursery.start_soon(goaway_on_drain, app.runtime, config)
        binds = await nursery.start(_serve_then_stop, app, config, nursery)
        task_status.started(binds)


async def _serve_then_stop(
    app: StreamscopeApp,
    config: Config,
    nursery: trio.Nursery,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run hypercorn until its drain is over (``wait_drained``), then end ``serve``'s
    nursery: the signal watcher and the GOAWAY task have no more to do.

    Cancellation: closed by its owner: hypercorn is cancelled as a whole, so each
    connection's task is cancelled and closes the streams its request opened
    (``StreamingConnection.__call__``) before hypercorn closes its socket. No graceful
    drain: hypercorn's ``graceful_timeout`` applies only to its own stop, and the cancel
    already covers its connections. ``nursery`` is not cancelled here: its own cancel is
    what reached this task.
    """
    await hypercorn.trio.serve(app, config, shutdown_trigger=app.runtime.wait_drained,
                               task_status=task_status)
    nursery.cancel_scope.cancel(reason="hypercorn has stopped")


async def _announce(app: StreamscopeApp, config: Config) -> None:
    """Serve, saying where, with which model on which device, and when it is ready.

    Cancellation: the server's streams are closed by their owners, with no drain, as
    ``serve`` says (each connection its own, the hub the rest); this task's own wait
    (``loading_outcome``) and prints leave nothing to undo.
    """
    settings = app.runtime.settings
    device = settings.device or "auto (cuda if available, else cpu)"
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)
        print(f"streamscope serve: listening on {', '.join(binds)}; model {settings.model}, "
              f"device {device}; backlog {config.backlog}, graceful timeout "
              f"{config.graceful_timeout:g} s, keep-alive {config.keep_alive_timeout:g} s",
              flush=True)
        phase = await app.runtime.loading_outcome()
        if phase is Phase.READY:
            print(f"streamscope serve: ready: model {settings.model} on device "
                  f"{_loaded(app.runtime, 'device') or device}, precision "
                  f"{_loaded(app.runtime, 'precision') or '?'} (STREAMSCOPE_DTYPE="
                  f"{settings.dtype})", flush=True)
        else:
            print(f"streamscope serve: not serving streams ({phase.value}): "
                  f"{app.runtime.failure or 'stopped while loading'}", flush=True)


def _loaded(runtime: Runtime, attribute: str) -> str | None:
    """What the engine's model was loaded with (``engine.Engine.loaded``'s ``device`` or
    ``precision``: what ``auto`` chose), where the engine has one (duck-typed: the app
    knows the engine only by its protocol)."""
    value = getattr(getattr(runtime.engine, "loaded", None), attribute, None)
    return None if value is None else str(value)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def configure_logging() -> None:
    """Our log lines on stderr beside hypercorn's, in its format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s", "%Y-%m-%d %H:%M:%S %z"))
    streamscope = logging.getLogger("streamscope")
    streamscope.addHandler(handler)
    streamscope.setLevel(logging.INFO)
    streamscope.propagate = False


def run_until_drained(app: StreamscopeApp, config: Config) -> None:
    """Serve ``app`` in this process, announced, until a signal has drained it: what
    ``app.cli.main`` does once the settings are read (the lab's ``tools/lab/_serve.py``
    serves its own app with it)."""
    raise_open_files_limit()
    trio.run(partial(_announce, app, config))

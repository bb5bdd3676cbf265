"""The composition root: ``create_app`` wires settings, runtime, routes and errors.

The one place where the app is assembled; ``app/__init__.py``'s ``app`` calls it once,
at its first ASGI call, with the settings from the environment; ``streamscope serve``
and the lab call it with theirs, tests with their own settings and engine.
"""

from __future__ import annotations

from pathlib import PurePath

from .auth import key_name, register_auth
from .edge import hypercorn_patches
from .edge.connection import StreamingConnection
from .edge.h2_retire import goaway_on_drain
from .edge.signals import watch_for_stop
from .error_handlers import register_error_handlers
from .hosts import register_host_check
from .metrics import Metrics, make_metrics_blueprint
from .quart_app import StreamscopeApp
from .request_record import Recorder
from .routes import (
    make_anthropic_blueprint,
    make_blueprint,
    make_openai_blueprint,
    make_page_blueprint,
    make_responses_blueprint,
    make_resumable_blueprint,
    make_scope_blueprint,
)
from .runtime import (
    MakeEngine,
    MakeHub,
    Rebuilder,
    Runtime,
    load_engine_from_settings,
    stop_deadline_s,
)
from .settings import Settings

__all__ = ["StreamscopeApp", "create_app"]


def create_app(
    settings: Settings | None = None,
    *,
    make_engine: MakeEngine | None = None,
    drain_on_sigterm: bool = False,
    make_hub: MakeHub | None = None,
) -> StreamscopeApp:
    """Build the app, and install the HTTP fixes in hypercorn (idempotent). Nothing is
    loaded until the server starts it (``before_serving``).

    Args:
        settings: default ``Settings.from_env()``.
        make_engine: builds the engine from the settings, in a worker thread; default
            loads ``settings.model`` (which imports torch).
        drain_on_sigterm: drain on SIGTERM, and when hypercorn's CLI stops, then stop
            hypercorn (``edge/signals.py``); for ``hypercorn -k trio app:app``, whose
            ``app`` sets it. It installs a process-wide SIGTERM handler while served.
        make_hub: makes the hub over the engine: none in the service (``streams.Hub``,
            stepping in a worker thread); the lab's ``naive`` device
            (``tools/lab/naive.py``: one step at a time, then a wait for the readers).

    Raises:
        SettingsError: a ``STREAMSCOPE_`` variable is invalid (when ``settings`` is None).
    """
    settings = Settings.from_env() if settings is None else settings
    # Before any server serves it: hypercorn 0.18's trio worker must build our TCPServer
    # (``edge/closing_server.py``: Connection: close, HTTP/1.0, keep-alive after an unread
    # body; installed by ``edge/hypercorn_patches.py``).
    hypercorn_patches.install()
    # No static_folder: Quart's default /static/<path> route would serve app/static, whose
    # pages have their own routes (routes/page.py, routes/scope.py) and headers.
    app = StreamscopeApp("app", static_folder=None)
    app.asgi_http_class = StreamingConnection  # its connections follow edge/connection.py
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,  # checked on Content-Length and as read
        BACKGROUND_TASK_SHUTDOWN_TIMEOUT=stop_deadline_s(settings),
    )
    runtime = Runtime(settings, make_engine or load_engine_from_settings, make_hub=make_hub)
    app.runtime = runtime
    recorder = Recorder.from_settings(settings, key_name)  # traces, JSON request lines; None: off
    app.metrics = metrics = Metrics(runtime.statistics,
                                    tenant_series=settings.metrics_token is not None,
                                    model_name=PurePath(settings.model).name,
                                    recorder=recorder)
    register_host_check(app, settings)  # keyless: local Host names only (DNS rebinding)
    register_auth(app, settings, runtime.shares)  # before any view reads a body
    register_error_handlers(app, on_refusal=metrics.refused)
    app.register_blueprint(make_blueprint(runtime, metrics))
    app.register_blueprint(make_openai_blueprint(runtime, metrics))
    app.register_blueprint(make_anthropic_blueprint(runtime, metrics))
    app.register_blueprint(make_resumable_blueprint(runtime, metrics))
    runtime.rebuild = Rebuilder(runtime, metrics)  # a dead replica's streams go on here
    app.register_blueprint(make_responses_blueprint(runtime, metrics))
    app.register_blueprint(make_page_blueprint())  # GET /: the browser page
    app.register_blueprint(make_scope_blueprint(runtime))  # GET /scope: the live view
    app.register_blueprint(make_metrics_blueprint(metrics))

    @app.before_serving
    async def start_runtime() -> None:
        """Start loading in the app's nursery and return at once. Cancellation: none."""
        runtime.start(app.nursery)
        if drain_on_sigterm:  # hypercorn -k trio app:app
            app.nursery.start_soon(watch_for_stop, runtime)
            app.nursery.start_soon(goaway_on_drain, runtime, None)  # its one server

    @app.after_serving
    async def stop_runtime() -> None:
        """Drain and stop the hub. Cancellation: see ``Runtime.stop``."""
        await runtime.stop()

    if recorder is not None:  # after stop_runtime: the drain's last spans are flushed too
        recorder.register(app)  # each response's status; the queued spans at the end
    return app

"""The app's class: a QuartTrio app that carries its runtime and metrics.

``factory.create_app`` builds it and gives it its connection class
(``edge.connection.StreamingConnection``); ``edge/connection.py`` knows the app only as
this class, so neither module imports the other's importer.
"""

from __future__ import annotations

from typing import Any

from quart.typing import ASGIReceiveCallable, ASGISendCallable
from quart_trio import QuartTrio

from .edge.worker_guard import refuse, running_under_trio
from .metrics import Metrics
from .runtime import Runtime


class StreamscopeApp(QuartTrio):
    """A QuartTrio app with the runtime and metrics its views and connections use."""

    runtime: Runtime
    metrics: Metrics

    async def __call__(
        self, scope: Any, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        """Serve one ASGI call, or refuse it loudly under a non-Trio worker
        (``edge/worker_guard.py``). ``scope`` is hypercorn's ``Scope``, which only
        ``app.edge`` imports. Cancellation: nothing to undo here (the guard holds
        nothing); in the app, each stream is closed by its owner, the connection."""
        if not running_under_trio():
            await refuse(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

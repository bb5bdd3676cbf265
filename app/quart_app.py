"""The app's class: a QuartTrio app that carries its runtime and metrics.

``factory.create_app`` builds it and gives it its connection class
(``connection.StreamingConnection``); ``connection.py`` knows the app only as this class,
so neither module imports the other's importer.
"""

from __future__ import annotations

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart_trio import QuartTrio

from .lifespan import Runtime
from .metrics import Metrics
from .worker_guard import refuse, running_under_trio


class StreamscopeApp(QuartTrio):
    """A QuartTrio app with the runtime and metrics its views and connections use."""

    runtime: Runtime
    metrics: Metrics

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        """Serve one ASGI call, or refuse it loudly under a non-Trio worker
        (``worker_guard.py``). Cancellation: as Quart's."""
        if not running_under_trio():
            await refuse(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

"""``/health``, ``/ready`` and ``/stats``: what a balancer and an operator ask the server.

Open without the API key (``auth.OPEN_PATHS``) but ``/stats``; none opens a stream.
"""

from __future__ import annotations

from quart import Blueprint, Response

from ..runtime import Phase, Runtime
from .serving import json_response


class HealthViews:
    """The views, bound to one app's runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def health(self) -> Response:
        """200 while the process is up (also while the model loads); 503 once the model
        failed to load or a step failed, since this process can serve nothing then.

        Cancellation: nothing to undo, as none can land: no checkpoint."""
        if self.runtime.phase is Phase.FAILED:
            refusal = self.runtime.refusal()
            assert refusal is not None
            raise refusal
        return json_response({"status": "ok", "phase": self.runtime.phase.value})

    async def ready(self) -> Response:
        """200 once the model is loaded and the hub runs, and the shared resume store
        (if set) answers; else 503 with the envelope.

        Cancellation: nothing to undo here: the store's ping is abandoned to its thread
        (``store_refusal``), which ends when the store answers or its socket times
        out."""
        refusal = self.runtime.refusal() or await self.runtime.store_refusal()
        if refusal is not None:
            raise refusal
        return json_response({"status": "ready", "phase": self.runtime.phase.value})

    async def stats(self) -> Response:
        """The engine's and hub's counters (``Runtime.statistics``). Cancellation: nothing to
        undo, as none can land: no checkpoint."""
        return json_response(self.runtime.statistics())


def add_health_routes(bp: Blueprint, runtime: Runtime) -> None:
    """``GET /health``, ``/ready`` and ``/stats`` on ``bp``."""
    views = HealthViews(runtime)
    bp.add_url_rule("/health", view_func=views.health, methods=["GET"])
    bp.add_url_rule("/ready", view_func=views.ready, methods=["GET"])
    bp.add_url_rule("/stats", view_func=views.stats, methods=["GET"])

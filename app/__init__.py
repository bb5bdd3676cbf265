"""The HTTP service: ``hypercorn -k trio app:app`` serves this package's ``app``.

Importing ``app`` or any ``app.*`` module (``app.settings``, ``app.runtime``) reads no
environment, builds nothing and patches nothing. ``app`` is a stand-in that hypercorn
can load by name (it reads the module's namespace, so a module ``__getattr__`` would not
do): its first ASGI call, the lifespan's startup, builds the service's app
(``factory.create_app``) from the ``STREAMSCOPE_*`` environment variables, draining on
SIGTERM (``edge/signals.py``); building it installs the HTTP fixes in hypercorn
(``edge/hypercorn_patches.py``) before hypercorn builds its first TCP server, which it does only
once the startup is over. Settings that cannot be read fail that startup with their
message, so hypercorn exits rather than serve without the app. The model loads when the
server starts, not here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .quart_app import StreamscopeApp

__all__ = ["app"]


class ServedApp:
    """The ASGI app of ``hypercorn -k trio app:app``, built at its first call."""

    def __init__(self) -> None:
        self._app: StreamscopeApp | None = None

    def built(self) -> StreamscopeApp:
        """The service's app, built from the environment on the first call."""
        if self._app is None:
            from .factory import create_app

            self._app = create_app(drain_on_sigterm=True)
            if self._app.runtime.settings.log_format == "json":  # no CLI set our logging
                from .request_log import install_json_logging

                install_json_logging()
        return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Build the app if it is not yet, then serve the call with it.

        Cancellation: nothing to undo in the build, which has no checkpoint; a cancel
        lands only in the app's own handling of the call, whose paragraphs say which of
        ``docs/cancellation.md``'s five outcomes it is.
        """
        if self._app is None and scope["type"] == "lifespan":
            from .settings import SettingsError

            try:
                self.built()
            except Exception as exc:  # a bad setting, or a broken install: say it, stop
                logging.getLogger("streamscope.app").error(
                    "cannot build the app: %s", exc,
                    exc_info=not isinstance(exc, SettingsError))  # its message says it all
                if (await receive())["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
        await self.built()(scope, receive, send)


app = ServedApp()

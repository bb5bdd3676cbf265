"""Refuse, loudly, to run under an ASGI worker that is not Trio's.

``hypercorn app:app`` without ``-k trio`` runs hypercorn's asyncio worker. A QuartTrio app
then fails deep inside quart-trio (``'RunContext' object has no attribute 'runner'``) on
every request, and its lifespan fails only as a warning, while hypercorn logs "Running
on ...": a server that looks up and serves nothing. ``StreamscopeApp.__call__`` asks
``sniffio`` which library runs it and, if it is not Trio, hands the call to ``refuse``:
the lifespan startup fails with one line naming the command that works (hypercorn then
exits), and a request that still arrives gets a 500 JSON envelope that says the same.

Why refuse rather than bridge: running the app on asyncio's loop through Trio's guest mode
would need hypercorn's asyncio ``receive``/``send`` carried across two event loops for
every event, with a client's disconnect still cancelling its stream's scope within a step
and shutdown still draining; that is a second server path to prove for every cancellation
test, for a command whose working form is one flag away.
"""

from __future__ import annotations

import json
import logging

import sniffio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

from ..errors import ErrorType

log = logging.getLogger("streamscope.app")

TRIO_COMMAND = "hypercorn -k trio app:app"
MESSAGE = (
    f"streamscope runs on Trio: start it with `{TRIO_COMMAND}` "
    "(without -k trio, hypercorn runs its asyncio worker, which cannot serve it)"
)


def running_under_trio() -> bool:
    """Whether the calling task runs under Trio."""
    try:
        return sniffio.current_async_library() == "trio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


async def refuse(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """Answer one ASGI call under a foreign worker: fail the lifespan startup, or a 500.

    Cancellation: nothing to undo: nothing is opened or held; the foreign worker ends
    the call as it ends any.
    """
    if scope["type"] == "lifespan":
        message = await receive()
        if message["type"] == "lifespan.startup":
            log.error("%s", MESSAGE)
            await send({"type": "lifespan.startup.failed", "message": MESSAGE})
    elif scope["type"] == "http":
        body = json.dumps(
            {"error": {"type": ErrorType.INTERNAL_ERROR.value, "message": MESSAGE}}
        ).encode()
        await send({
            "type": "http.response.start",
            "status": 500,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        })
        await send({"type": "http.response.body", "body": body, "more_body": False})
    else:  # a websocket: this server has none
        await send({"type": "websocket.close", "code": 1011, "reason": None})

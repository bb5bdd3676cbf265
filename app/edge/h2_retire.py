"""Which HTTP/2 connections a server has, and retiring them all when it drains.

``h2_protocol.GuardedH2Protocol`` registers each connection here under its server
(hypercorn's ``Config``). ``goaway_on_drain`` waits for the runtime's drain and then
retires every one (``GuardedH2Protocol.retire``: a GOAWAY and the close once it has no
stream running); a connection made during the drain retires once it has started a
stream (``is_draining``).

Two ways it runs. ``streamscope serve`` starts it beside hypercorn with the Config it
serves (``cli.py``). Under ``hypercorn -k trio app:app`` the app never sees hypercorn's
Config, so the app starts it with ``config=None`` beside the signal watcher
(``factory.py``, ``drain_on_sigterm``): every server in the process, which there is one
worker's one server. Without it hypercorn's own stop closed an idle HTTP/2 connection
with no GOAWAY, and a client could not tell a server going away from a broken connection.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import trio
from hypercorn.config import Config

from ..runtime import Phase, Runtime

# How often goaway_on_drain looks at the runtime's phase (the runtime has no event for a
# drain's start); as often as signals.py polls hypercorn's stop Event.
DRAIN_POLL_S = 0.1


class Retirable(Protocol):
    def retire(self, why: str) -> None: ...


# Per server (hypercorn's Config): its live HTTP/2 connections, and whether it drains.
_connections: weakref.WeakKeyDictionary[Config, weakref.WeakSet[Retirable]] = (
    weakref.WeakKeyDictionary())
_draining: weakref.WeakSet[Config] = weakref.WeakSet()
_draining_everywhere = False  # goaway_on_drain(config=None) saw the drain


def register(config: Config, connection: Retirable) -> None:
    _connections.setdefault(config, weakref.WeakSet()).add(connection)


def forget(config: Config, connection: Retirable) -> None:
    _connections.get(config, weakref.WeakSet()).discard(connection)


def connections_of(config: Config | None) -> list[Retirable]:
    """The server's live HTTP/2 connections (``None``: every server's in this process)."""
    if config is None:
        return [c for connections in list(_connections.values()) for c in connections]
    return list(_connections.get(config, ()))


def is_draining(config: Config) -> bool:
    return _draining_everywhere or config in _draining


async def goaway_on_drain(runtime: Runtime, config: Config | None) -> None:
    """Once ``runtime`` drains, retire each of ``config``'s server's HTTP/2 connections
    (``None``: every server's in this process), and each new one after its first
    stream. Returns then.

    Cancellation: nothing to undo: the wait is only for the drain to begin; no GOAWAY
    was sent yet, and none is sent after.
    """
    global _draining_everywhere
    # The runtime's drain has no event to wait on; a phase is a plain attribute.
    while runtime.phase not in (Phase.DRAINING, Phase.STOPPED):  # noqa: ASYNC110
        await trio.sleep(DRAIN_POLL_S)
    if config is None:
        _draining_everywhere = True
    else:
        _draining.add(config)
    for connection in connections_of(config):
        connection.retire("drain")

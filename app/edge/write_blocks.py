"""Telling a request's streams that its response's write waits for the client.

A writer blocked in its write (an HTTP/1.1 socket that does not take the bytes, an
HTTP/2 stream whose flow-control window is shut) is a slow reader: the hub must not hold
every other stream's tokens for it (``streams/stepper.py``; the stream's policy deals
with it). The protocol layers know when a write blocks (``body_hot_path``: the non-blocking
``os.write`` took only part; ``h2_flow``: the stream's buffer is full); the request's
connection knows what it owns (``connection.close_with_connection``). The write runs in
the request's own task, so the connection puts its owned list in a context variable (``serving``)
that the protocol layer reads (``write_blocked``). Stdlib only: both sides import it.
"""

from __future__ import annotations

import contextvars
from typing import Protocol, runtime_checkable


@runtime_checkable
class BlockableWriter(Protocol):
    """What wants to know (``streams.TokenStream.write_blocked``): sync, no checkpoint."""

    def write_blocked(self) -> None: ...


# What the request served in this task owns; its child tasks inherit it.
_owned: contextvars.ContextVar[list[object]] = contextvars.ContextVar("streamscope_owned")


def serving(owned: list[object]) -> None:
    """Called by the request's connection in its task before it runs the request: the
    writes of this task (and of tasks it starts) are that request's."""
    _owned.set(owned)


def write_blocked() -> None:
    """Called by a protocol layer, in the request's task, when the response's write must
    wait for the client: tells each stream the request owns. Sync, never a checkpoint;
    a no-op outside a request."""
    for owned in _owned.get([]):
        if isinstance(owned, BlockableWriter):
            owned.write_blocked()

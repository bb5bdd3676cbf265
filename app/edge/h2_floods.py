"""Flood budgets for one HTTP/2 connection (CVE-2023-44487, "rapid reset", and its kin).

hypercorn's mitigation (pgjones/hypercorn#146, closed by its commit 926c430) is
``keep_alive_max_requests``: after 1,000 requests a connection is closed. That bounds
nothing per second: a client that opens and resets streams in a loop makes the server
start a request (a task, the route, a prompt's encode, sometimes the engine's admission)
for every one of its 1,000, and then opens another connection (issue 25's probe put 33
of 300 such streams into the engine; one that reset each stream 10 ms after opening it,
all 300). And hypercorn answers every PING and SETTINGS frame whatever their number. So
each connection has three budgets (``FloodBudget``: a token bucket; a burst, refilled at
a rate): stream resets (the client's ``RST_STREAM``s, and the server's that the client's
frames caused), ``PING``s and ``SETTINGS`` frames. A frame past its
budget gets ``GOAWAY`` with ``ENHANCE_YOUR_CALM`` and the connection is closed
(``h2_protocol.GuardedH2Protocol``): its streams see a disconnect, so their sequences
are cancelled like any client's that left.

A stream that its client reset in the same read that opened it ("stillborn") is never
started at all: hypercorn would start its request only to cancel it a moment later; and
such streams have a budget of their own, far smaller, since a real client seldom cancels
a request before the server could have read it: a rapid-reset connection is cut off
within its first slice, before its hundredth reset is parsed (an attacker that connects
again at once made the server parse 100 triples per connection, 40 connections a second:
``tools.lab rapidreset``'s ``reconnect``). And a read is parsed ``SLICE_BYTES`` at a
time: h2 parses all of what it is given before anyone can count, and 64 KiB of a flood's
small frames held the event loop for tens of milliseconds, every other client's stream
with it.

MadeYouReset (CVE-2025-8671): a client need not send the RST_STREAM itself. A frame
that is a stream error (a WINDOW_UPDATE that overflows the stream's window, DATA or
HEADERS on a stream the client ended) makes h2 reset the stream on the server's side:
a ``StreamReset`` event with ``remote_reset`` False, its RST_STREAM sent by the server,
and hypercorn cancels the stream's request exactly as for the client's reset. Counting
only the client's RST_STREAMs let such a flood through every budget (30 streams in one
write drew 30 RST_STREAMs from the server and no GOAWAY, 20 of them opened in the
engine). Every ``StreamReset`` h2 reports is the client's doing (h2 reports none for a
reset the server chose, as ``REFUSED_STREAM``), so each one is counted, against the same
budgets: stillborn if the stream opened in the same read, else ``RST_STREAM``. Other
servers count the same: h2o applies its reset mitigation wherever a stream is
unregistered, an invalid WINDOW_UPDATE's too (h2o/h2o#3502); netty budgets the
RST_STREAMs its encoder sends (CVE-2025-55163, eclipse-vertx/vert.x#5675); undertow
answers too many RST_STREAMs sent with a GOAWAY (undertow-io/undertow#1778).

The defaults are far above what a browser or an SDK does (a page that closes all of its
``EventSource``s resets a few dozen streams at once; keep-alive PINGs come seconds apart)
and far below a flood's rate. What a flood can still make this server start, per
connection, is at most ``RESET_BURST`` plus ``RESETS_PER_S`` a second plus the streams
it holds open (``h2_max_concurrent_streams``).

CONTINUATION floods (CVE-2024-27316 and its kin: a header block that never ends) are
bounded by h2 itself (``h2.frame_buffer.CONTINUATION_BACKLOG``, 64 frames of at most
hypercorn's ``h2_max_inbound_frame_size`` each, then a connection error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard

import h2.events

# Client RST_STREAMs a connection may send at once, and per second after that.
RESET_BURST = 100
RESETS_PER_S = 10.0
# Of those, of streams reset in the read that opened them (never started).
STILLBORN_BURST = 16
STILLBORN_PER_S = 2.0
# PING frames: keep-alive pings come seconds apart.
PING_BURST = 50
PINGS_PER_S = 5.0
# SETTINGS frames: a client sends one or two.
SETTINGS_BURST = 20
SETTINGS_PER_S = 2.0
# What one parse of h2 takes at most (see GuardedH2Protocol._handle_in_slices): a
# request's head and a few frames; a quarter of a default frame.
SLICE_BYTES = 1024


class FloodBudget:
    """A token bucket: ``burst`` at once, refilled at ``per_s`` a second up to ``burst``."""

    def __init__(self, burst: int, per_s: float, now: float) -> None:
        self.burst, self.per_s = burst, per_s
        self.tokens = float(burst)
        self.at = now

    def spend(self, now: float) -> bool:
        """Take one token at time ``now``; False when none is left."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


def is_reset(event: h2.events.Event) -> TypeGuard[h2.events.StreamReset]:
    """Whether ``event`` ends a stream by a reset: the client's RST_STREAM, or the
    server's own in answer to the client's frames (``remote_reset`` False:
    MadeYouReset, see the module docstring)."""
    return isinstance(event, h2.events.StreamReset)


class FloodBudgets:
    """One connection's budgets, by the frame they count (see the module docstring)."""

    def __init__(self, now: float) -> None:
        self.budgets = {
            "RST_STREAM": FloodBudget(RESET_BURST, RESETS_PER_S, now),
            "stillborn RST_STREAM": FloodBudget(STILLBORN_BURST, STILLBORN_PER_S, now),
            "PING": FloodBudget(PING_BURST, PINGS_PER_S, now),
            "SETTINGS": FloodBudget(SETTINGS_BURST, SETTINGS_PER_S, now),
        }

    def judge(self, events: Sequence[h2.events.Event], now: float) -> str | None:
        """Spend what one read's ``events`` cost at time ``now``: the frame whose budget
        they exceed, if any."""
        opened = {e.stream_id for e in events if isinstance(e, h2.events.RequestReceived)}
        for event in events:
            if is_reset(event):
                if event.stream_id in opened and not self.budgets[
                        "stillborn RST_STREAM"].spend(now):
                    return "stillborn RST_STREAM"
                frame = "RST_STREAM"
            elif isinstance(event, h2.events.PingReceived):
                frame = "PING"
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                frame = "SETTINGS"
            else:
                continue
            if not self.budgets[frame].spend(now):
                return frame
        return None

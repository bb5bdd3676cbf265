"""The leak experiment's streams: what each client is drawn to do, and the doing of it.

Why a module of its own: ``leak.py`` is the procedure (clients, bursts, the server's state
before and after) and its report; this is how one stream behaves, as ``leak.py``'s
docstring describes the kinds: ``plan_streams`` draws a ``StreamPlan`` per stream with
``lab.rng``, ``run_stream`` reads and leaves as its plan says, and ``run_burst_stream`` is
one stream of a burst. ``LeakStream`` is the lab's ``RawStream`` (``_raw.py``) plus the
ways of sending a request that only this experiment needs: part of it, all of it but its
last byte (the rest later), or with ``Connection: close``.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import h11
import trio

from tools.lab._raw import RECV_BYTES, RawStream, RawStreamError
from tools.lab.common import Lab

EOF_WAIT_S = 2.0  # after a Connection: close stream's end, for the server's EOF
# Each kind's share of the streams, in the order drawn (see ``leak.py``'s docstring).
KINDS = (("full", 0.25), ("leave", 0.35), ("slow", 0.10), ("early", 0.10),
         ("never_read", 0.08), ("close", 0.12))
READ_TO_END = ("full", "close")


@dataclass(frozen=True)
class StreamPlan:
    """What one stream's client does."""

    index: int
    prompt: str
    max_new_tokens: int
    kind: str  # one of KINDS
    leave_after: int | None  # leave, slow: tokens read before leaving (None: read to the end)
    way: str | None  # "fin" or "rst"
    moment: str | None = None  # early: "mid_request", "after_request" or "after_delay"
    hold_s: float = 0.0  # early after_delay, never_read: how long before leaving


class LeakStream(RawStream):
    """A ``RawStream`` that can send part of its request, or ``Connection: close``."""

    eof_after_end: bool | None = None  # close: the server's EOF came after the body's end
    unsent: bytes = b""  # what ``send`` held back (a ``fraction`` below 1, ``hold_back``)

    async def send(self, path: str, body: dict[str, Any], *, close: bool = False,
                   fraction: float = 1.0, hold_back: int = 0) -> None:
        """Send the request, or its first ``fraction`` of bytes, or all but its last
        ``hold_back`` bytes (the rest is kept in ``unsent``). Cancellation: closed by its
        owner: the socket is the caller's, and stays open, the request perhaps half
        sent; the caller resets it on its way out (``run_stream``'s ``finally``:
        ``close_rst``, synchronous)."""
        if not self._connected:
            await self.connect()
        payload = json.dumps(body).encode()
        headers = [("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json"),
                   ("Content-Length", str(len(payload)))]
        if close:
            headers.append(("Connection", "close"))
        data = self.conn.send(h11.Request(method="POST", target=path, headers=headers))
        data += self.conn.send(h11.Data(data=payload)) + self.conn.send(h11.EndOfMessage())
        cut = len(data) - hold_back if hold_back else max(1, int(len(data) * fraction))
        data, self.unsent = data[:cut], data[cut:]
        await self._send_all(data)

    async def send_unsent(self) -> None:
        """Send what ``send`` held back: the request is complete from here."""
        data, self.unsent = self.unsent, b""
        await self._send_all(data)

    async def _send_all(self, data: bytes) -> None:
        self.sent_at, self.sent_wall = time.perf_counter(), time.time()
        while data:
            data = data[await self.sock.send(data):]

    async def wait_eof(self, timeout_s: float) -> None:
        """After the body's end: did the server close within ``timeout_s``?"""
        self.eof_after_end = False
        with trio.move_on_after(timeout_s):
            try:
                while await self.sock.recv(RECV_BYTES):
                    pass
            except OSError:
                pass  # a reset is a close too
            self.eof_after_end = True


def plan_streams(lab: Lab, count: int) -> list[StreamPlan]:
    """One plan per stream, drawn with ``lab.rng`` (so ``--seed`` repeats a run): each
    kind in its ``KINDS`` share, with smaller ranges in the quick form."""
    token_range = lab.pick((48, 64), (16, 24))
    leave_range = lab.pick((0, 40), (0, 12))
    slow_after = lab.pick((3, 10), (3, 6))
    hold_range = lab.pick((0.1, 2.0), (0.05, 0.3))
    prompts = lab.prompts()
    plans = []
    for i in range(count):
        draw = lab.rng.random()
        tokens = lab.rng.randint(*token_range)
        way = lab.rng.choice(("fin", "rst"))
        prompt = prompts[i % len(prompts)]
        kind = next((k for k, edge in _kind_edges() if draw < edge), KINDS[-1][0])
        if kind in READ_TO_END:
            plans.append(StreamPlan(i, prompt, tokens, kind, None, None))
        elif kind == "leave":
            plans.append(StreamPlan(i, prompt, tokens, kind, lab.rng.randint(*leave_range), way))
        elif kind == "slow":
            plans.append(StreamPlan(i, prompt, tokens, kind, lab.rng.choice(slow_after), way))
        elif kind == "early":
            moment = lab.rng.choice(("mid_request", "after_request", "after_delay"))
            plans.append(StreamPlan(i, prompt, tokens, kind, None, way, moment,
                                    lab.rng.uniform(0, 0.05)))
        else:
            plans.append(StreamPlan(i, prompt, tokens, kind, None, way,
                                    hold_s=lab.rng.uniform(*hold_range)))
    return plans


def _kind_edges() -> list[tuple[str, float]]:
    edges, total = [], 0.0
    for kind, share in KINDS:
        total += share
        edges.append((kind, total))
    return edges


async def run_stream(url: str, plan: StreamPlan, pause_s: float) -> LeakStream:
    """One stream, read and left as ``plan`` says. Cancellation: closed by its owner:
    this is the socket's owner, and its ``finally`` resets it unless it closed already
    (``close_rst``: synchronous, so it runs in the cancelled scope); the server reads a
    client gone, and its connection closes the stream."""
    stream = LeakStream(url)
    body = {"prompt": plan.prompt, "ignore_eos": True, "max_new_tokens": plan.max_new_tokens}
    try:
        if plan.kind in READ_TO_END:
            await stream.send("/v1/stream", body, close=plan.kind == "close")
            await stream.read_to_end()
            if plan.kind == "close" and stream.terminal == "done":
                await stream.wait_eof(EOF_WAIT_S)
            return stream
        assert plan.way is not None
        if plan.kind == "early":
            await stream.send("/v1/stream", body,
                              fraction=0.5 if plan.moment == "mid_request" else 1.0)
            if plan.moment == "after_delay":
                await trio.sleep(plan.hold_s)
        elif plan.kind == "never_read":
            await stream.send("/v1/stream", body)
            await trio.sleep(plan.hold_s)
        elif plan.kind == "slow":
            assert plan.leave_after is not None
            await stream.send("/v1/stream", body)
            while stream.request_id is None or stream.tokens < plan.leave_after:
                if not await stream.read_chunk():
                    break
                await trio.sleep(pause_s)
        else:
            after = plan.leave_after
            assert after is not None
            await stream.send("/v1/stream", body)
            with contextlib.suppress(RawStreamError):  # refused (429) in a burst: it ended
                await stream.read_until(lambda s: s.request_id is not None and s.tokens >= after)
        await stream.close(plan.way)
    finally:
        if stream.closed_at is None:
            stream.close_rst()
    return stream


async def run_burst_stream(url: str, plan: StreamPlan, tokens: int, go: trio.Event,
                           out: list[LeakStream], *,
                           task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """One stream of a burst: all of the request but its last byte, then (``go``) the last
    byte; read to the end (or the refusal), then reset."""
    stream = LeakStream(url)
    try:
        body = {"prompt": plan.prompt, "ignore_eos": True, "max_new_tokens": tokens}
        await stream.send("/v1/stream", body, hold_back=1)
        task_status.started()
        await go.wait()
        await stream.send_unsent()
        await stream.read_to_end()
    finally:
        stream.close_rst()
        out.append(stream)

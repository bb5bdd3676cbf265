"""``h2slowstream``: one stream whose window stays shut, and its neighbours on the connection.

HTTP/2 flow control is per stream: a reader may send no WINDOW_UPDATE for one stream and
go on reading the others on its connection. That stream must be a slow reader under its
policy, its neighbours unhurt (issue 25, item 2): ``app/edge/h2_flow.py``'s ``FlowBuffer``
makes its writer wait, the hub's queue fills, ``pause_drop`` pauses it, then drops it.

Procedure. A run is one HTTP/2 connection in the clear with prior knowledge (h2c: the
lab's server has no TLS), driven frame by frame with ``h2``, its connection window
granted once, hugely, so that only the per-stream windows (65,535 bytes) limit the
server. ``STEADY`` streams (greedy, ``ignore_eos``, ``--tokens``: default 96, quick 320)
are acknowledged as their DATA arrives; in a loud run one more (as many tokens, sent
first) is never acknowledged while they run. Token events are padded with 4 KiB
(``lab_pad_bytes``), so its window and hypercorn's 32 KiB buffer fill within about 24
tokens; queue limit 8, stall timeout 2 s: on SmolLM2 the drop comes well before the
steady streams end (on the tiny model, quick, often after them), and a steady stream's
reader would have to stall for two seconds to be dropped itself (the quick form runs
beside eight other servers in the test suite). Then the lab's ``GET
/v1/lab/requests/<id>`` says when the engine let the slow stream go, and its reader
comes back (acknowledges all) and reads it to its end: the server's last word.
``/stats`` is polled every 0.1 s in every run (quiet ones too: the same load) for the
streams paused. A warm-up run, then ``--rounds`` (default 5; quick 1) of a quiet and a
loud run, alternating so that the machine's noise falls on both.

Summary: ``gap_p99_ms_quiet``/``_loud`` (median over rounds of the steady streams' token
gap p99), ``p99_ratio`` (loud over quiet; goal at most ``p99_goal``), ``gap_p50_ms_*``
likewise; ``steady_complete`` (all tokens and ``done``, every steady stream); of the slow
stream, ``slow_tokens_read`` (median tokens before its reader came back),
``slow_ended_after_s`` (median s from its request to the engine letting it go),
``slow_end`` (its last word: ``error:TYPE``, ``done``, ``reset:CODE``, ``http_STATUS`` or
``open``; ``slow_ends`` counts them), ``steady_past_drop`` (the steady streams still ran
then, every loud run); ``paused_max_quiet``/``_loud`` (/stats ``paused_streams``);
``slow_client_drops``, ``opened``, ``events_dropped`` (/stats, after minus before the
counted runs). Raw: every run's gaps and streams. Plot: the steady gaps' distributions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import trio

from streams import SSEParser
from tools.lab._raw import finish_record, host_port
from tools.lab.common import Lab, Report, experiment, median, ms, pct, plot_gap_cdfs

STEADY = 3
P99_GOAL = 1.5
PAD_BYTES = 4096
STALL_S = 2.0
CONNECTION_WINDOW = 2**30
READ_TIMEOUT_S = 120.0  # a safety net: every read waits for a condition
POLL_S = 0.1


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, help="quiet and loud runs, each (default 5)")
    parser.add_argument("--tokens", type=int, help="per steady stream (default 96)")


class _Stream:
    """One request's stream as the client saw it."""

    def __init__(self, stream_id: int, held: bool) -> None:
        self.stream_id, self.held, self.parser = stream_id, held, SSEParser()
        self.unacknowledged = 0  # bytes received while held
        self.token_times: list[float] = []  # perf_counter of each token's arrival
        self.request_id: str | None = None
        self.status, self.body = 0, b""  # the body, if not 200: a refusal's JSON envelope
        self.end: str | None = None  # done, error:TYPE, reset:CODE, ended (no event)
        self.sent_perf = self.sent_wall = 0.0

    def on_data(self, data: bytes, now: float) -> None:
        if self.status != 200:
            self.body += data
            return
        for sse in self.parser.feed(data):
            if sse.event == "token":
                self.token_times.append(now)
            elif sse.event == "start":
                self.request_id = json.loads(sse.data)["id"]
            elif sse.event == "done":
                self.end = self.end or "done"
            elif sse.event == "error":
                self.end = self.end or f"error:{json.loads(sse.data)['error']['type']}"


class _Connection:
    """An HTTP/2 connection over a Trio TCP stream; reads happen only in ``read_until``."""

    def __init__(self, tcp: trio.SocketStream, authority: str) -> None:
        self.tcp, self.authority, self.eof = tcp, authority.encode(), False
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()  # queued: the first flush sends the preface
        self.conn.increment_flow_control_window(CONNECTION_WINDOW)
        self.streams: dict[int, _Stream] = {}

    async def flush(self) -> None:
        if data := self.conn.data_to_send():
            await self.tcp.send_all(data)

    def post(self, body: dict[str, Any], *, held: bool = False) -> _Stream:
        """Queue a POST /v1/stream; ``flush`` sends it."""
        payload = json.dumps(body).encode()
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [
            (b":method", b"POST"), (b":scheme", b"http"), (b":authority", self.authority),
            (b":path", b"/v1/stream"), (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode())])
        self.conn.send_data(stream_id, payload, end_stream=True)
        self.streams[stream_id] = stream = _Stream(stream_id, held)
        return stream

    async def read_until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Read and handle frames until ``condition()`` (False: the end or ``timeout_s``)."""
        with trio.move_on_after(timeout_s):
            while not condition() and not self.eof:
                data = await self.tcp.receive_some(65536)
                now = time.perf_counter()
                self.eof = not data
                for event in self.conn.receive_data(data) if data else ():
                    self._handle(event, now)
                await self.flush()
        return condition()

    def _handle(self, event: h2.events.Event, now: float) -> None:
        stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
        if stream is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            stream.status = int(dict(event.headers)[b":status"])
        elif isinstance(event, h2.events.DataReceived):
            stream.on_data(bytes(event.data), now)
            if stream.held:
                stream.unacknowledged += event.flow_controlled_length
            else:
                self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                    stream.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            stream.end = stream.end or ("ended" if stream.status == 200
                                        else f"http_{stream.status}")
        elif isinstance(event, h2.events.StreamReset):
            stream.end = stream.end or f"reset:{getattr(event.error_code, 'name', '?')}"

    async def release(self, stream: _Stream) -> None:
        """The held stream's reader comes back: acknowledge what it received."""
        if stream.unacknowledged and stream.end is None:
            self.conn.acknowledge_received_data(stream.unacknowledged, stream.stream_id)
        stream.held, stream.unacknowledged = False, 0
        await self.flush()

    async def close(self) -> None:
        self.conn.close_connection()  # GOAWAY, then the FIN
        with trio.move_on_after(5):
            await self.flush()
        await self.tcp.aclose()


@experiment("h2slowstream",
            "HTTP/2: one stream whose window stays shut beside steady ones on the same "
            "connection: paused, dropped, and the others' gap p99 against a quiet run",
            server={"lab_pad_bytes": PAD_BYTES, "queue_limit": 8, "stall_timeout_s": STALL_S},
            arguments=arguments)
async def h2slowstream(lab: Lab) -> Report:
    rounds = lab.option("rounds", 5, 1)
    tokens = lab.option("tokens", 96, 320)
    prompts = lab.prompts(STEADY + 1)

    await lab.wait_idle()
    warm_up = await _run(lab, prompts, tokens, loud=False)
    before = await lab.wait_idle()
    runs: list[dict[str, Any]] = []
    for index in range(rounds):
        for loud in (False, True):
            runs.append({"round": index, **await _run(lab, prompts, tokens, loud=loud)})
            await lab.wait_idle()
    after = await lab.wait_idle()

    def fig(key: str, loud: bool) -> float | None:
        return median([r[key] for r in runs if r["loud"] == loud])

    slow = [r["slow"] for r in runs if r["loud"]]
    ends = Counter(s["end"] for s in slow)
    quiet_p99, loud_p99 = fig("gap_p99_s", False), fig("gap_p99_s", True)
    summary: dict[str, Any] = {
        **{f"gap_{q}_ms_{name}": ms(fig(f"gap_{q}_s", loud))
           for q in ("p99", "p50") for name, loud in (("quiet", False), ("loud", True))},
        "p99_ratio": round(loud_p99 / quiet_p99, 2) if quiet_p99 and loud_p99 else None,
        "p99_goal": P99_GOAL,
        "steady_complete": all(r["steady_complete"] for r in runs),
        "slow_tokens_read": median([s["tokens_held"] for s in slow]),
        "slow_ended_after_s": _round(median([s["released_s"] for s in slow])),
        "slow_end": ends.most_common(1)[0][0] if ends else None, "slow_ends": dict(ends),
        "steady_past_drop": all(s["steady_past_drop"] for s in slow),
        "paused_max_quiet": max((r["paused_max"] for r in runs if not r["loud"]), default=0),
        "paused_max_loud": max((r["paused_max"] for r in runs if r["loud"]), default=0),
        **{k: int(after.get(k) or 0) - int(before.get(k) or 0)
           for k in ("slow_client_drops", "opened", "events_dropped")},
        "tokens": tokens, "rounds": rounds,
    }
    raw = {"warm_up": warm_up, "runs": runs, "stats_before": before, "stats_after": after}
    return Report(summary, raw, plot=lambda f: _draw(f, runs))


async def _run(lab: Lab, prompts: list[str], tokens: int, *, loud: bool) -> dict[str, Any]:
    """One connection: the steady streams read to their ends (beside the slow one, when
    ``loud``); their gaps, and what happened to the slow one."""
    host, port = host_port(lab.url)
    h2c = _Connection(await trio.open_tcp_stream(host, port), f"{host}:{port}")
    slow = None
    if loud:  # its reader stops at once: no WINDOW_UPDATE for it while the others run
        slow = h2c.post({"prompt": prompts[STEADY], "max_new_tokens": tokens,
                         "ignore_eos": True}, held=True)
    steady = [h2c.post({"prompt": p, "max_new_tokens": tokens, "ignore_eos": True})
              for p in prompts[:STEADY]]
    paused = 0

    async def watch_pauses(client: httpx.AsyncClient) -> None:
        nonlocal paused
        while True:
            paused = max(paused, int((await lab.stats(client=client))["paused_streams"]))
            await trio.sleep(POLL_S)

    started = time.perf_counter()
    async with lab.client() as client, trio.open_nursery() as nursery:
        nursery.start_soon(watch_pauses, client)
        for stream in (*steady, *([slow] if slow else [])):
            stream.sent_perf, stream.sent_wall = time.perf_counter(), time.time()
        await h2c.flush()
        await h2c.read_until(lambda: all(s.end for s in steady), READ_TIMEOUT_S)
        steady_ended = time.perf_counter()
        nursery.cancel_scope.cancel(reason="the steady streams ended")
    gaps = [b - a for s in steady for a, b in zip(s.token_times, s.token_times[1:], strict=False)]
    run: dict[str, Any] = {
        "loud": loud, "duration_s": round(steady_ended - started, 3),
        "gap_p99_s": pct(gaps, 99), "gap_p50_s": pct(gaps, 50), "paused_max": paused,
        "steady_complete": all(s.end == "done" and len(s.token_times) == tokens for s in steady),
        "steady": [{"tokens": len(s.token_times), "end": s.end,
                    "token_ms": [ms(t - started, 2) for t in s.token_times]} for s in steady],
        "gaps_s": [round(g, 5) for g in gaps]}
    if slow is not None:
        run["slow"] = await _finish_slow(lab, h2c, slow, steady_ended)
    await h2c.close()
    return run


async def _finish_slow(lab: Lab, h2c: _Connection, slow: _Stream,
                       steady_ended: float) -> dict[str, Any]:
    """When the engine let the slow stream go; then its reader comes back and reads it to
    its end."""
    held_tokens, end_while_held = len(slow.token_times), slow.end
    async with lab.client() as client:
        # Let go by now (past its stall timeout)? If not, it runs on once read: ask again.
        record = await _record(client, slow.request_id, 4 * STALL_S + 2)
        await h2c.release(slow)
        await h2c.read_until(lambda: slow.end is not None, 30.0)
        record = record or await _record(client, slow.request_id, 30.0)
    released_s = None if record is None else record["finished_at"] - slow.sent_wall
    return {"request_id": slow.request_id, "tokens_held": held_tokens,
            "tokens": len(slow.token_times), "end": slow.end or "open",
            "end_while_held": end_while_held, "released_s": _round(released_s),
            "steady_past_drop": released_s is not None and slow.sent_perf + released_s
            < steady_ended, "finish_reason": (record or {}).get("finish_reason"),
            "refusal": slow.body.decode(errors="replace")[:300] or None}


async def _record(client: httpx.AsyncClient, request_id: str | None,
                  timeout_s: float) -> dict[str, Any] | None:
    """The lab's finish record of ``request_id``, or None if none came in ``timeout_s``."""
    with contextlib.suppress(trio.TooSlowError, httpx.HTTPError):
        if request_id is not None:
            return await finish_record(client, request_id, timeout_s)
    return None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _draw(fig: Any, runs: list[dict[str, Any]]) -> None:
    axis = fig.subplots()
    plot_gap_cdfs(axis, {label: [g for r in runs if r["loud"] == loud for g in r["gaps_s"]]
                         for loud, label in ((False, "quiet"),
                                             (True, "beside a stream whose window stays shut"))},
                  whose="a steady stream's")
    axis.set_title("steady streams on one HTTP/2 connection: alone, and beside a slow stream")

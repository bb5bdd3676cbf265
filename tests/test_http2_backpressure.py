"""Per-stream backpressure over HTTP/2 (issue 25, item 2): a stream whose reader stops
sending WINDOW_UPDATEs for it is a slow reader under its stream's policy, while the
other streams on the same connection keep their pace.

HTTP/2 flow control is per stream: hypercorn sends a stream's DATA only while its window
is open, buffers up to 32 KiB more of it (``BUFFER_HIGH_WATER``), and then the app's
write for that stream waits, and only that one. From there it is the slow reader of
HTTP/1.1: the hub's queue for the stream fills, the policy (``pause_drop``) pauses the
sequence, and past ``stall_timeout_s`` drops it with ``slow_client`` (the engine cancels
it, its blocks come back). The lab's padded token events (4 KiB each) fill the window
and the buffer within a few tokens. The engine's steps are paced (``RecordingEngine.
pace``) so that a stream's token gaps are the pace's, whatever the machine: the other
streams' gaps are compared with the same streams' on a run without the slow one.
"""

from __future__ import annotations

import json
import statistics
from functools import partial

import pytest
import trio

from engine import FinishReason
from tests.http2_clients import H2Client, H2Stream
from tests.http_clients import stream_body
from tests.http_server import POLL_S, RunningServer, StartServer
from tests.tls import Certificate
from tools.lab._app import create_lab_app
from tools.lab._settings import LabSettings

pytestmark = pytest.mark.alone  # gaps with and without the slow stream, in real time

PACE_S = 0.01  # one engine step
TOKENS = 120  # each steady stream's; 1.2 s at the pace, past the slow one's drop
STALL_S = 0.4
STREAM_WINDOW = 65535  # the client's initial window per stream (HTTP/2's default)
STEADY = 3
# How much the steady streams' 99th-percentile gap may grow beside a slow stream: the
# issue's 1.5x, plus a few milliseconds for a busy machine's scheduling noise.
P99_FACTOR, P99_SLACK_S = 1.5, 0.004


async def padded_server(start_tls: StartServer) -> RunningServer:
    return await start_tls(create=partial(create_lab_app, lab=LabSettings(pad_bytes=4096)),
                           max_batch=8, queue_limit=8, stall_timeout_s=STALL_S)


def gaps(stream: H2Stream) -> list[float]:
    return [b - a for a, b in zip(stream.arrivals, stream.arrivals[1:], strict=False)]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


async def steady_run(
    server: RunningServer, certificate: Certificate, *, with_slow: bool
) -> tuple[list[float], int, H2Client, H2Stream | None]:
    """The steady streams on one connection (and the slow one, if asked) read to their
    ends: their token gaps, the most streams paused at once meanwhile, the client, and
    the slow stream."""
    client = await H2Client.connect(server, certificate, stream_window=STREAM_WINDOW)
    slow = None
    if with_slow:
        slow = client.start_post("/v1/stream", stream_body(max_new_tokens=400, ignore_eos=True))
        slow.held = True  # its reader stops at once: no WINDOW_UPDATE for it, ever
    steady = [client.start_post("/v1/stream", stream_body(max_new_tokens=TOKENS,
                                                          ignore_eos=True))
              for _ in range(STEADY)]
    paused = 0

    async def watch_pauses() -> None:
        nonlocal paused
        while True:
            paused = max(paused, server.hub.statistics().paused_streams)
            await trio.sleep(POLL_S)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_pauses)
        await client.flush()
        await client.read_until(lambda: all(s.ended for s in steady))
        nursery.cancel_scope.cancel(reason="the steady streams ended")
    for stream in steady:
        assert stream.events[-1].event == "done" and len(stream.tokens()) == TOKENS
    return [g for s in steady for g in gaps(s)], paused, client, slow


async def quiet_and_loud(
    server: RunningServer, certificate: Certificate
) -> tuple[list[float], list[float], int, H2Client, H2Stream]:
    """The steady streams alone, then beside a slow one: both runs' gaps, the most
    streams paused at once beside the slow one, its client and the slow stream."""
    server.recorder.pace(PACE_S)
    quiet, paused_quiet, client, _ = await steady_run(server, certificate, with_slow=False)
    await client.close_clean()
    assert paused_quiet == 0
    loud, paused, client, slow = await steady_run(server, certificate, with_slow=True)
    assert slow is not None
    return quiet, loud, paused, client, slow


async def test_a_stream_whose_window_stays_shut_is_paused_then_dropped_as_a_slow_client(
    start_tls: StartServer, certificate: Certificate
) -> None:
    server = await padded_server(start_tls)
    quiet, loud, paused, client, slow = await quiet_and_loud(server, certificate)
    finish = await server.wait_finished(server.recorder.submitted[-STEADY - 1])

    assert paused == 1  # the policy paused the slow stream, and it alone,
    assert finish.reason is FinishReason.CANCELLED  # then dropped it: the engine let it go
    assert finish.completion_tokens < 400
    assert server.hub.statistics().slow_client_drops == 1
    # The others lost nothing: every token (steady_run), at the same rate.
    assert sum(loud) <= 1.2 * sum(quiet) + 0.05, (sum(loud), sum(quiet))

    # Its reader comes back: what was queued, then the policy's last word.
    await client.release(slow)
    await client.read_until(lambda: slow.ended)
    error = slow.events[-1]
    assert error.event == "error"
    assert json.loads(error.data)["error"]["type"] == "slow_client"
    assert slow.events[0].event == "start" and 0 < len(slow.tokens()) < 400
    await client.close_clean()


async def test_the_neighbours_of_a_slow_stream_keep_their_gap_p99(
    start_tls: StartServer, certificate: Certificate
) -> None:
    server = await padded_server(start_tls)
    quiet, loud, _, client, slow = await quiet_and_loud(server, certificate)
    await client.release(slow)
    await client.read_until(lambda: slow.ended)
    await client.close_clean()

    assert statistics.median(loud) <= P99_FACTOR * statistics.median(quiet) + P99_SLACK_S
    assert p99(loud) <= P99_FACTOR * p99(quiet) + P99_SLACK_S, (p99(loud), p99(quiet))

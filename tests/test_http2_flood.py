"""Floods on one HTTP/2 connection are bounded (issue 25, item 3; CVE-2023-44487).

``h2_protocol.GuardedH2Protocol`` gives each connection budgets of client RST_STREAMs, PINGs
and SETTINGS frames; past one, GOAWAY ``ENHANCE_YOUR_CALM`` and the connection closes.
A stream that its client resets in the same read that opened it is never started. The
floods are raw frames (``tools.h2flood.flood_frames``), sent as fast as the socket takes
them, over TLS; a flood of resets of streams that did start (each reset after the
stream's first event) is driven frame by frame by ``H2Client``.

Without the fixes (hypercorn 0.18 alone, measured here): 10,000 HEADERS + DATA + RST_STREAM
triples started 1,122 requests before hypercorn closed the connection (its
``keep_alive_max_requests``, then a PROTOCOL_ERROR), 0.85 s in; 10,000 PINGs got 10,000
answers and no GOAWAY, 10,000 SETTINGS no GOAWAY; resets of streams that started get
none, whatever their number. With them: the GOAWAY within 30 ms, no request started.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Awaitable, Callable
from functools import partial

import h2.errors
import h2.exceptions
import pytest
import trio

from app.edge import h2_floods, h2_protocol
from app.edge.h2_floods import FloodBudget
from tests.http2_clients import H2Client, H2Stream
from tests.http_clients import stream_body
from tests.http_server import RunningServer, StartServer
from tests.tls import Certificate
from tools.h2flood import Attacker, flood, flood_frames

ENHANCE_YOUR_CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
REFUSED_STREAM = h2.errors.ErrorCodes.REFUSED_STREAM
FLOOD = 10_000  # the issue's: HEADERS + DATA + RST_STREAM triples on one connection
PACE_S = 0.01
VICTIM_TOKENS = 120
P99_FACTOR, P99_SLACK_S = 1.5, 0.004
ATTACK_S = 1.5  # the attacker's floods are spread over this long: the victims' run
ROUNDS = 5  # the median of 5 alternated rounds: 3 let a loaded machine (load 14) decide


@pytest.fixture
async def tls_server(start_tls: StartServer) -> RunningServer:
    return await start_tls(max_batch=8)


def test_a_flood_budget_is_a_token_bucket() -> None:
    budget = FloodBudget(burst=3, per_s=2.0, now=0.0)

    assert [budget.spend(0.0) for _ in range(4)] == [True, True, True, False]
    assert budget.spend(0.4) is False  # 0.8 of a token came back: not one yet
    assert budget.spend(0.5) is True  # one
    assert [budget.spend(100.0) for _ in range(4)] == [True, True, True, False]  # burst caps


async def assert_still_serves(server: RunningServer, certificate: Certificate) -> None:
    client = await H2Client.connect(server, certificate)
    stream = await client.post("/v1/stream", stream_body(max_new_tokens=4, ignore_eos=True))
    await client.read_until(lambda: stream.ended)
    assert [e.event for e in stream.events] == ["start"] + ["token"] * 4 + ["done"]
    await client.close_clean()


@pytest.mark.parametrize("kind", ["reset", "madeyoureset", "ping", "settings"])
async def test_a_flood_gets_goaway_enhance_your_calm_and_starts_nothing(
    tls_server: RunningServer, certificate: Certificate, kind: str
) -> None:
    frames = flood_frames(kind, FLOOD)

    result = await flood(tls_server.host, tls_server.port, certificate.client_context(),
                         frames)

    assert result.goaway is not None and result.goaway.error_code == ENHANCE_YOUR_CALM
    reason = "stillborn RST_STREAM" if "reset" in kind else kind.upper()
    assert result.goaway.additional_data == f"too many {reason} frames".encode()
    # Read and thrown away meanwhile; the connection closes within the linger.
    assert result.elapsed_s <= h2_protocol.LINGER_S + 2.0
    assert result.ping_acks <= h2_floods.PING_BURST
    # Each reset stream was reset in the read that opened it: none was started.
    assert tls_server.recorder.submitted == []
    await assert_still_serves(tls_server, certificate)


async def test_a_few_streams_reset_as_they_open_are_not_a_flood(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    client = await H2Client.connect(tls_server, certificate)
    for _ in range(h2_floods.STILLBORN_BURST // 2):  # an impatient client's, in one write
        client.start_post("/v1/stream", stream_body(max_new_tokens=4), reset=True)
    await client.flush()
    stream = await client.post("/v1/stream", stream_body(max_new_tokens=4, ignore_eos=True))

    await client.read_until(lambda: stream.ended)
    assert [e.event for e in stream.events] == ["start"] + ["token"] * 4 + ["done"]
    assert client.goaway is None
    assert len(tls_server.recorder.submitted) == 1  # the reset ones never started
    await client.close_clean()


async def test_streams_the_server_resets_as_they_open_are_a_flood(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    # MadeYouReset (CVE-2025-8671), the probe: 30 streams in one write, each with
    # a WINDOW_UPDATE that overflows its window; the server resets each one itself
    # (h2's StreamReset with remote_reset=False), and the client sends no RST_STREAM.
    frames = flood_frames("madeyoureset", 30)

    result = await flood(tls_server.host, tls_server.port, certificate.client_context(),
                         frames)

    assert result.goaway is not None and result.goaway.error_code == ENHANCE_YOUR_CALM
    assert result.goaway.additional_data == b"too many stillborn RST_STREAM frames"
    assert result.server_resets <= h2_floods.STILLBORN_BURST
    assert len(tls_server.recorder.submitted) <= h2_floods.STILLBORN_BURST
    for request_id in tls_server.recorder.submitted:
        await tls_server.wait_finished(request_id)
    await assert_still_serves(tls_server, certificate)


async def test_a_continuation_flood_is_cut_off_by_h2(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    # CVE-2024-27316's kin: one header block that never ends. h2 refuses a block of more
    # than CONTINUATION_BACKLOG frames (a connection error, GOAWAY PROTOCOL_ERROR): the
    # server closes the connection, its header buffer bounded. (With the backlog raised
    # to a billion, the flood's 10,000 frames were all taken and the connection stayed
    # open until the flood's read timed out.)
    frames = flood_frames("continuation", FLOOD)

    result = await flood(tls_server.host, tls_server.port, certificate.client_context(),
                         frames)

    assert result.server_closed
    assert result.goaway is not None
    assert result.goaway.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert tls_server.recorder.submitted == []
    await assert_still_serves(tls_server, certificate)


def started_or_goaway(client: H2Client, stream: H2Stream) -> bool:
    return bool(stream.events) or client.goaway is not None


@pytest.mark.parametrize("how", ["client_reset", "window_overflow"])
async def test_resets_of_streams_that_started_are_bounded(
    tls_server: RunningServer, certificate: Certificate, monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    # ``window_overflow``: MadeYouReset; the server resets each stream itself.
    monkeypatch.setattr(h2_floods, "RESET_BURST", 5)
    monkeypatch.setattr(h2_floods, "RESETS_PER_S", 1.0)
    client = await H2Client.connect(tls_server, certificate)
    started = trio.current_time()
    resets = 0
    with contextlib.suppress(trio.BrokenResourceError, h2.exceptions.ProtocolError):
        while client.goaway is None and resets < 100:  # (h2 refuses to send after one)
            stream = await client.post("/v1/stream", stream_body(max_new_tokens=400,
                                                                  ignore_eos=True))
            await client.read_until(partial(started_or_goaway, client, stream))
            if how == "client_reset":
                await client.reset(stream)
            else:
                await client.overflow_window(stream)
            resets += 1
    await client.read_to_eof()
    elapsed = trio.current_time() - started

    assert client.goaway is not None and client.goaway.error_code == ENHANCE_YOUR_CALM
    bound = 5 + elapsed * 1.0 + 1
    assert resets <= bound + 1
    assert len(tls_server.recorder.submitted) <= bound + 1
    for request_id in tls_server.recorder.submitted:  # every one was cancelled
        await tls_server.wait_finished(request_id)
    await assert_still_serves(tls_server, certificate)


async def test_keep_alive_max_requests_ends_a_connection_with_a_graceful_goaway(
    start_tls: StartServer, certificate: Certificate
) -> None:
    server = await start_tls(max_batch=8, hypercorn={"keep_alive_max_requests": 3})
    client = await H2Client.connect(server, certificate)
    running = [client.start_post("/v1/stream", stream_body(max_new_tokens=60, ignore_eos=True))
               for _ in range(3)]
    late = client.start_post("/v1/stream", stream_body(max_new_tokens=4))  # the 4th
    await client.flush()

    await client.read_until(lambda: all(s.done for s in running) and late.done)
    assert late.reset == REFUSED_STREAM  # not processed: safe to retry elsewhere
    for stream in running:  # hypercorn's own close would have cut these short
        assert stream.events[-1].event == "done" and len(stream.tokens()) == 60
    await client.read_to_eof()  # and then the GOAWAY, and the server closed the connection
    assert client.goaway is not None
    assert (client.goaway.error_code, client.goaway.last_stream_id) == (0, 5)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


async def victims_gaps(
    server: RunningServer, certificate: Certificate,
    attack: Callable[[], Awaitable[None]] | None,
) -> list[float]:
    """Two streams on their own connection read to their ends, with ``attack`` (floods
    from other connections) running meanwhile: their token gaps."""
    client = await H2Client.connect(server, certificate)
    victims: list[H2Stream] = [
        client.start_post("/v1/stream", stream_body(max_new_tokens=VICTIM_TOKENS,
                                                     ignore_eos=True)) for _ in range(2)]
    await client.flush()
    async with trio.open_nursery() as nursery:
        if attack is not None:
            nursery.start_soon(attack)
        await client.read_until(lambda: all(v.ended for v in victims))
        nursery.cancel_scope.cancel(reason="the victims are done")
    await client.close_clean()
    for victim in victims:
        assert len(victim.tokens()) == VICTIM_TOKENS
    return [b - a for v in victims for a, b in zip(v.arrivals, v.arrivals[1:], strict=False)]


@pytest.mark.alone  # real time: its own phases compared
async def test_other_clients_keep_their_pace_through_floods(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    tls_server.recorder.pace(PACE_S)
    quiet: list[float] = []
    loud: list[float] = []
    async with Attacker.running(tls_server.host, tls_server.port, ATTACK_S,
                                cert=certificate.cert) as attacker:
        for _ in range(ROUNDS):  # alternately, so that the machine's own noise hits both
            quiet.append(p99(await victims_gaps(tls_server, certificate, None)))
            loud.append(p99(await victims_gaps(tls_server, certificate, attacker.start_round)))
            await attacker.round_results()

    assert len(attacker.results) == 3 * ROUNDS  # a flood of each kind a round
    assert all(r["goaway"] == ENHANCE_YOUR_CALM for r in attacker.results), attacker.results
    assert statistics.median(loud) <= P99_FACTOR * statistics.median(quiet) + P99_SLACK_S, (
        loud, quiet)
    assert len(tls_server.recorder.submitted) == 4 * ROUNDS  # the victims', nothing else

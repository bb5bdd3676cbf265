"""Hostile requests to every JSON route, over real HTTP: no 5xx, no hang, nothing left behind.

Issue 8, "Hostile traffic". The cases come from ``tools/hostile_cases.py`` and are sent
and judged by ``tools/hostile_client.py`` (both shared with ``python -m tools.lab fuzz``):
arbitrary bytes and JSON, wrong types, huge numbers, deep nesting, NUL, invalid UTF-8,
bodies over the limit, odd content types, chunked bodies, bodies that end early (then
FIN), slowloris heads; each on its own raw socket to one hypercorn server on the tiny
model. Each must be answered (or, if incomplete, answered
or closed) within a bound, never with a 5xx, and the server must be settled after each:
no stream registered, the cache whole, every admitted sequence released once.

Hypothesis drives synchronous examples, and the server lives in the test's Trio run: the
examples run in a worker thread (``trio.to_thread``), each sent back into the Trio loop
with ``trio.from_thread.run``. One server serves every example.
"""

from __future__ import annotations

from functools import partial

import trio
from hypothesis import HealthCheck, given, settings

from tests.http_server import RunningServer
from tools import hostile_cases, hostile_client
from tools.hostile_cases import Framing, HostileCase

# A few hundred cases in all, about 10 s on an idle 2-core machine.
MAX_EXAMPLES = 300
CASE_TIMEOUT_S = 10.0  # a safety net: a case is answered in milliseconds
# hypercorn closes a connection whose request never arrives after keep_alive_timeout
# (5 s by default); its slowloris test waits that long, plus a margin, and no longer. The
# slowest head takes 1.1 s to send (a byte every 10 ms): the margin leaves 2 s besides.
KEEP_ALIVE_TIMEOUT_S = 5.0
SILENT_BOUND_S = KEEP_ALIVE_TIMEOUT_S + 3.0
FRAMINGS = tuple(Framing)
EARLY_END_ROUNDS = 10  # 90 requests: the crash came within 5 to 25


def check_outcome(case: HostileCase, outcome: hostile_client.Outcome) -> None:
    where = f"{outcome!r} for {case!r}"
    assert not outcome.five_xx, where
    assert not outcome.hang, where
    assert not outcome.internal_error, where
    if not _cut_after_client_left(case, outcome):
        assert outcome.protocol_error is None, where
    if case.framing not in hostile_cases.INCOMPLETE:
        assert outcome.answered, where


def _cut_after_client_left(case: HostileCase, outcome: hostile_client.Outcome) -> bool:
    """A response cut short by the close, after the client's own FIN: the client left.

    hypercorn takes a read EOF for the client gone (as this server's disconnect detection
    does: docs/cancellation.md) and drops the app's later sends, so a 413 decided by
    Content-Length whose head went out just before the FIN of an unfinished body loses
    its body (once in a few hundred cases here)."""
    return (case.framing in hostile_cases.INCOMPLETE and case.fin and outcome.closed
            and outcome.status is not None and outcome.protocol_error is not None
            and outcome.protocol_error.startswith(
                "peer closed connection without sending complete message body"))


async def test_hostile_requests_are_answered_without_5xx_and_leave_nothing(
    server: RunningServer,
) -> None:
    # Connection: close is not honoured yet by hypercorn 0.18 (issue 8, defect 1): the
    # client does not wait for EOF here (eof_wait_s=0), it only reads the framed answer.

    @settings(max_examples=MAX_EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=hostile_cases.cases(
        max_body_bytes=server.app.runtime.settings.max_body_bytes, framings=FRAMINGS))
    def one_case(case: HostileCase) -> None:
        outcome = trio.from_thread.run(partial(
            hostile_client.send_case, server.host, server.port, case, timeout_s=CASE_TIMEOUT_S))
        check_outcome(case, outcome)
        trio.from_thread.run(server.assert_settled)

    await trio.to_thread.run_sync(one_case)


async def test_silent_slowloris_connections_are_closed_and_do_not_stall_others(
    server: RunningServer,
) -> None:
    # Heads sent byte by byte, then silence: only the server's own timeout can end them.
    head = HostileCase("valid", "/v1/stream", b'{"prompt": "hi"}', "application/json",
                       Framing.SLOWLORIS).head(f"{server.host}:{server.port}")
    abandoned = [HostileCase("valid", path, b'{"prompt": "hi"}', "application/json",
                             Framing.SLOWLORIS, cut=cut, pace_s=0.01, fin=False)
                 for path in hostile_cases.ROUTES for cut in (1, len(head) // 2, len(head) - 1)]
    outcomes: list[tuple[HostileCase, hostile_client.Outcome]] = []  # in the order they end

    async def send(case: HostileCase) -> None:
        outcomes.append((case, await hostile_client.send_case(
            server.host, server.port, case, silent_timeout_s=SILENT_BOUND_S)))

    async with trio.open_nursery() as nursery:
        for case in abandoned:
            nursery.start_soon(send, case)
        # The heads are on their way (connected in milliseconds, a byte every 10 ms). Not
        # a condition the test needs: the answer below must come while every slowloris is
        # still open, and the first is closed KEEP_ALIVE_TIMEOUT_S (5 s) after its last
        # byte; the half second and a 2-token answer fit in that on a machine 5x slower.
        await trio.sleep(0.5)
        async with server.client() as client:
            response = await client.post("/v1/generate", json={"prompt": "hi",
                                                               "max_new_tokens": 2})
        assert response.status_code == 200
        assert len(outcomes) == 0  # the answer came while every slowloris was still open

    assert len(outcomes) == len(abandoned)
    for case, outcome in outcomes:
        assert outcome.closed and not outcome.hang and outcome.status in (None, 408), \
            (case, outcome)
    await server.assert_settled()


# Found by this fuzz (issue 8): hypercorn 0.18's trio TCPServer answers h11's "peer
# closed connection without sending complete message body" with a 400 from its reader
# task while the app's task may be sending on the same socket; trio raises
# BusyResourceError, which TCPServer.run does not catch, and it ends the whole server
# (hypercorn.trio.serve returns with it; every later connection is refused). Within 5-25
# such requests here. Until the server is fixed, SHORT cases stay out of the hypothesis
# test (``FRAMINGS``) and this test is expected to fail; drop both once it passes.
async def test_bodies_that_end_early_then_fin_are_answered_or_closed(
    server: RunningServer,
) -> None:
    body = b'{"prompt": "The capital of France is", "max_new_tokens": 2}'
    for _ in range(EARLY_END_ROUNDS):
        for path in hostile_cases.ROUTES:
            for missing in (1, len(body), 100_000):
                case = HostileCase("valid", path, body, "application/json", Framing.SHORT,
                                   missing=missing)
                outcome = await hostile_client.send_case(server.host, server.port, case)
                check_outcome(case, outcome)
                assert outcome.status in (None, 400, 413), (case, outcome)
    await server.assert_settled()


def test_every_case_is_sent_as_its_framing_says() -> None:
    case = HostileCase("valid", "/v1/stream", b"abcdef", None, Framing.CHUNKED,
                       chunks=(2, 1), connection_close=True)
    assert case.wire("h") == (b"POST /v1/stream HTTP/1.1\r\nHost: h\r\n"
                              b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                              b"2\r\nab\r\n1\r\nc\r\n3\r\ndef\r\n0\r\n\r\n")
    short = HostileCase("x", "/v1/generate", b"{}", "text/plain", Framing.SHORT, missing=5)
    assert short.wire("h").endswith(b"Content-Length: 7\r\n\r\n{}")
    cut = HostileCase("x", "/v1/generate", b"{}", None, Framing.SLOWLORIS, cut=4)
    assert cut.wire("h") == b"POST"
    assert len(hostile_cases.sample_cases(50, 1)) == 50
    assert hostile_cases.sample_cases(20, 7) == hostile_cases.sample_cases(20, 7)  # repeatable

"""A draining replica hands its running resumable streams over (issue 11), and a stream
made by ``POST /v1/requests`` is in the shared store before its 201.

Real processes, as in ``tests/test_failover.py``: a ``redis-server`` and two
``streamscope serve`` replicas on the tiny model sharing it. Replica A gets SIGTERM with
a short ``STREAMSCOPE_SHUTDOWN_GRACE_S``; its resumable streams still running
``HANDOVER_LEAD_S`` before the drain's deadline stop there (no final event: the bodies
just end), their events in Redis and their owner leases let go, and a client that
resumes on B reads on with the tokens of an uninterrupted run (greedy and seeded), every
event id once; a stream A made and B read all along continues in the same response (B
takes it over). A exits 0 with its cache whole. Missing ``redis-server`` FAILS the tests
with the command that installs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio

from app.runtime import HANDOVER_LEAD_S
from streams import ServerSentEvent, SSEParser
from tests.http_clients import parse_sse
from tests.test_failover import (
    FOLLOWED,
    GREEDY,
    SEEDED,
    client_of,
    positions,
    read_through,
    replicas,
    resume_until_done,
    token_ids,
    wait_whole,
    whole_stream,
)
from tests.test_replicas import redis_process, redis_url  # noqa: F401 (fixtures)
from tools.cluster import Replica

# The hand-over comes HANDOVER_LEAD_S before the drain's deadline: with a grace of just
# that, at the signal. Then the streams need not outlast a timer (a longer grace had a
# fast machine finish them first: 190 of their 482 events were out at the hand-over 0.5 s
# after the signal here), only the work between their 10th event and the signal.
GRACE_S = HANDOVER_LEAD_S
TOKENS = 480  # with ignore_eos (tiny-gpt2 holds 512): still running at the hand-over
WAIT_S = 60.0


def body(sampling: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"prompt": "A replica drains and", "max_new_tokens": TOKENS, "ignore_eos": True,
            **sampling, **fields}


async def uninterrupted(replica: Replica, sampling: dict[str, Any]) -> list[int]:
    return await whole_stream(replica, body(sampling))


async def read_until_the_body_ends(replica: Replica, sampling: dict[str, Any], k: int,
                                   got_k: trio.Event, out: list[Any]) -> None:
    """A resumable stream on ``replica``, read until its body ends; ``out`` gets
    [request_id, events], ``got_k`` is set once k events came."""
    parser = SSEParser()
    events: list[ServerSentEvent] = []
    async with client_of(replica) as client, \
            client.stream("POST", "/v1/stream", json=body(sampling, resumable=True)) as response:
        assert response.status_code == 200
        out += [response.headers["X-Request-ID"], events]
        async for chunk in response.aiter_bytes():
            events += parser.feed(chunk)
            if len(events) >= k:
                got_k.set()


async def test_a_draining_owner_hands_its_running_streams_over_and_they_continue_identically(
    redis_url: str, tmp_path: Path,  # noqa: F811
) -> None:
    """Failed before the hand-over: the streams ended with ``error`` ``shutdown`` at the
    drain's deadline, and the remote read with it."""
    samplings = [GREEDY, SEEDED]
    followed: list[ServerSentEvent] = []
    async with replicas("ab", redis_url, tmp_path, shutdown_grace_s=GRACE_S) as (a, b), \
            trio.open_nursery() as nursery:
        async with httpx.AsyncClient(base_url=a.url, trust_env=False) as client:
            created = await client.post("/v1/requests", json=body(FOLLOWED))
            assert created.status_code == 201, created.text
            follow_id = created.json()["id"]
        following = trio.Event()
        nursery.start_soon(read_through, b, follow_id, 10, following, followed)
        await following.wait()
        cut: list[list[Any]] = [[] for _ in samplings]
        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as readers:
                started = [trio.Event() for _ in samplings]
                for sampling, got_k, out in zip(samplings, started, cut, strict=True):
                    readers.start_soon(read_until_the_body_ends, a, sampling, 10, got_k, out)
                for got_k in started:
                    await got_k.wait()
                a.terminate()  # SIGTERM: the drain
            exit_code = await a.wait_exit()

        results = []
        for (request_id, received), sampling in zip(cut, samplings, strict=True):
            expected = await uninterrupted(b, sampling)
            rest, _ = await resume_until_done(b, request_id, positions(received)[-1])
            results.append((request_id, received, rest, expected))
        expected_followed = await uninterrupted(b, FOLLOWED)
        with trio.fail_after(WAIT_S):
            while not followed or followed[-1].event not in ("done", "error"):  # noqa: ASYNC110
                await trio.sleep(0.05)  # (the reading task's list)
        whole_b = await wait_whole(b)
    log_a = a.log()

    assert exit_code == 0, log_a[-3000:]
    assert "3 resumable streams handed over" in log_a, log_a[-3000:]
    assert "cache whole: True" in log_a, log_a[-3000:]
    for request_id, received, rest, expected in results:
        assert received[-1].event == "token", (request_id, received[-1])  # no final event
        events = received + rest
        assert positions(events) == list(range(1, TOKENS + 3)), request_id
        assert token_ids(events) == expected, request_id
        assert events[-1].event == "done"
        assert json.loads(events[-1].data)["usage"]["completion_tokens"] == TOKENS
    assert positions(followed) == list(range(1, TOKENS + 3))  # in one response, on B
    assert token_ids(followed) == expected_followed
    assert followed[-1].event == "done"
    assert whole_b["resume_failovers"] == 3


async def test_a_resume_on_another_replica_right_after_the_201_reads_the_whole_stream(
    redis_url: str, tmp_path: Path,  # noqa: F811
) -> None:
    """``POST /v1/requests`` on A, at once ``GET`` of its stream_url on B: 200 and every
    event. Failed before the 201 waited for the store: B answered 204 (unknown stream)
    when its look came before A's writer had put the stream in Redis."""
    rounds = 20
    answers: list[tuple[int, list[ServerSentEvent]]] = []
    async with replicas("ab", redis_url, tmp_path) as (a, b), \
            httpx.AsyncClient(base_url=a.url, timeout=WAIT_S, trust_env=False) as on_a, \
            httpx.AsyncClient(base_url=b.url, timeout=WAIT_S, trust_env=False) as on_b:
        await on_b.get("/health")  # a kept-alive connection: the GET goes out at once
        for i in range(rounds):
            created = await on_a.post("/v1/requests", json={
                "prompt": f"Right after the 201, number {i}", "max_new_tokens": 4,
                "ignore_eos": True})
            assert created.status_code == 201, created.text
            got = await on_b.get(created.json()["stream_url"])
            answers.append((got.status_code, parse_sse(got.content)))

    assert [status for status, _ in answers] == [200] * rounds
    for _, events in answers:
        assert positions(events) == list(range(1, 4 + 3))
        assert events[-1].event == "done"

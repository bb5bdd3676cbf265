"""Several replicas (issue 11, first part): the resumable-stream log in a real Redis, a
stream resumed on another replica, directly and through a real HAProxy running
``deploy/haproxy.cfg``.

The tests start ``redis-server`` and ``haproxy`` on loopback with free ports; a missing
binary FAILS the test with the command that installs it (CI installs both). The two
replicas are in-process hypercorn servers (``tests/http_server.py``) on the tiny model,
sharing one Redis through ``STREAMSCOPE_RESUME_STORE``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
import trio

from engine import FinishReason
from streams import ServerSentEvent, SSEParser
from streams.resume import Holding, RedisEventLog
from streams.resume.redis_keys import events_key, reader_key
from tests.http_clients import RawClient, long_body, stream_body
from tests.http_server import RunningServer, StartServer

SHORT_TOKENS = 12  # 14 events: start, 12 tokens, done
# What the replicas sign the store's data with (STREAMSCOPE_RESUME_SECRET): the same on
# every replica of a test, as in a deployment.
RESUME_SECRET = "streamscope-tests-resume-secret-0123456789"
START_TIMEOUT_S = 10.0
DEPLOY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "deploy")


# -- the real processes --------------------------------------------------------------

def binary(name: str, package: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if os.path.exists(p)), None)
    if path is None:
        pytest.fail(f"{name} is missing: apt-get update && apt-get install -y {package}")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Sync poll, for a process starting (no Trio loop in a session fixture)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def spawn_redis() -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on a free loopback port, no persistence, answering; and its URL."""
    port = free_port()
    process = subprocess.Popen(
        [binary("redis-server", "redis-server"), "--bind", "127.0.0.1", "--port", str(port),
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_until(lambda: _pings(url), "redis-server")
    except BaseException:
        process.kill()
        raise
    return process, url


def _pings(url: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_process() -> Iterator[str]:
    """The shared Redis of these tests; yields its URL."""
    process, url = spawn_redis()
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def own_redis() -> Iterator[tuple[str, Callable[[], None]]]:
    """A Redis of the test's own, and a function that kills it (SIGKILL)."""
    process, url = spawn_redis()

    def kill() -> None:
        process.kill()
        process.wait(timeout=10)

    yield url, kill
    kill()


@pytest.fixture
def redis_url(redis_process: str) -> Iterator[str]:
    """The shared Redis, empty."""
    client = redis.Redis.from_url(redis_process)
    client.flushdb()
    yield redis_process
    client.close()


@pytest.fixture
def haproxy() -> Iterator[Callable[[RunningServer, RunningServer], str]]:
    """``start(a, b)``: HAProxy with deploy/haproxy.cfg in front of two replicas; returns
    its base URL once both replicas pass its health check."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(a: RunningServer, b: RunningServer) -> str:
        port = free_port()
        env = {**os.environ, "STREAMSCOPE_LB_BIND": f"127.0.0.1:{port}",
               "STREAMSCOPE_LB_REPLICA_A": f"{a.host}:{a.port}",
               "STREAMSCOPE_LB_REPLICA_B": f"{b.host}:{b.port}"}
        process = subprocess.Popen(
            [binary("haproxy", "haproxy"), "-db", "-f", os.path.join(DEPLOY, "haproxy.cfg")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        processes.append(process)
        return f"http://127.0.0.1:{port}"

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


# -- helpers ---------------------------------------------------------------------------

def redis_log(url: str, **options: Any) -> RedisEventLog:
    """A replica's log in the Redis at ``url``, signing with the tests' secret."""
    return RedisEventLog.from_url(url, secret=RESUME_SECRET, **options)


def short_body(**fields: Any) -> dict[str, Any]:
    return stream_body(max_new_tokens=SHORT_TOKENS, ignore_eos=True, **fields)


def parse(raw: bytes) -> list[ServerSentEvent]:
    parser = SSEParser()
    return parser.feed(raw) + parser.close()


def token_ids(events: list[ServerSentEvent]) -> list[int]:
    return [json.loads(e.data)["id"] for e in events if e.event == "token"]


def positions(events: list[ServerSentEvent], request_id: str) -> list[int]:
    result = []
    for e in events:
        assert e.id is not None
        stream_id, _, n = e.id.rpartition(":")
        assert stream_id == request_id
        result.append(int(n))
    return result


def holding(server: RunningServer, request_id: str) -> Holding:
    registry = server.app.runtime.resumption
    assert registry is not None
    return registry.holding(request_id)


async def cut_after(host: str, port: int, owner: Callable[[str], RunningServer],
                    body: dict[str, Any], k: int) -> tuple[str, list[ServerSentEvent]]:
    """POST a resumable stream, read k events, reset the connection, and wait until its
    owner noticed (the stream is detached there). Returns its id and the k events."""
    client = RawClient(host, port)
    await client.post("/v1/stream", {**body, "resumable": True})
    await client.read_until(lambda events: len(events) >= max(k, 1))
    request_id = client.request_id()
    received = client.events[:k]
    client.close_abort()
    server = owner(request_id)
    await server.wait_for(lambda: holding(server, request_id) is Holding.DETACHED,
                          f"{request_id} detached")
    return request_id, received


async def get_resume(base_url: str, request_id: str, last: str | None) -> httpx.Response:
    headers = {} if last is None else {"Last-Event-ID": last}
    async with httpx.AsyncClient(base_url=base_url, timeout=START_TIMEOUT_S) as client:
        return await client.get(f"/v1/stream/{request_id}", headers=headers)


async def two_replicas(start_server: StartServer, redis_url: str,
                       **settings: Any) -> tuple[RunningServer, RunningServer]:
    a = await start_server(resume_store=redis_url, resume_secret=RESUME_SECRET, **settings)
    b = await start_server(resume_store=redis_url, resume_secret=RESUME_SECRET, **settings)
    return a, b


# -- the log in Redis ------------------------------------------------------------------

async def test_redis_log_replays_follows_and_expires(redis_url: str) -> None:
    log = redis_log(redis_url, ttl_s=30.0)
    store = redis.Redis.from_url(redis_url)
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        log.append("s1", 1, b"one")
        log.append("s1", 2, b"two")
        with pytest.raises(ValueError, match="follows"):
            log.append("s1", 4, b"gap")
        await log.flush()

        assert await log.tail("s1") == (2, False)
        assert log.read_after("s1", 0) == [b"one", b"two"]  # the owner's local copy
        assert await log.read_remote("s1", 1, wait_s=0.1) == [(2, b"two", False)]
        assert 0 < store.pttl(events_key("s1")) <= 30_000

        async def append_later() -> None:
            await trio.sleep(0.05)
            log.append("s1", 3, b"three", last=True)

        nursery.start_soon(append_later)
        followed = await log.read_remote("s1", 2, wait_s=5.0)  # blocks until it comes
        assert followed == [(3, b"three", True)]
        assert await log.tail("s1") == (3, True)

        assert log.expire("s1") == len(b"onetwothree")
        await log.flush()
        assert await log.read_remote("s1", 0, wait_s=0.1) is None
        assert await log.tail("s1") is None
        nursery.cancel_scope.cancel()
    store.close()


async def test_redis_log_keys_die_with_their_time_to_live(redis_url: str) -> None:
    """An owner that stops refreshing (it died) leaves nothing behind after ttl_s."""
    # The tail read right after the flush is one round trip to Redis, a millisecond: well
    # inside the 0.3 s on a machine 5x slower. Then the test waits for the keys to go.
    log = redis_log(redis_url, ttl_s=0.3, lease_s=0.5, follow_wait_s=0.1)
    log.append("s2", 1, b"one")
    await log.flush()  # no run(): nobody refreshes, as after a SIGKILL
    assert await log.tail("s2") == (1, False)
    with trio.fail_after(START_TIMEOUT_S):
        while await log.tail("s2") is not None:  # noqa: ASYNC110 (Redis's clock)
            await trio.sleep(0.05)
    assert await log.read_remote("s2", 0, wait_s=0.1) is None


async def test_reader_lease_is_taken_over_by_the_newest_reader(redis_url: str) -> None:
    # Each check comes a round trip or two (milliseconds) after the claim it looks at:
    # none of the 0.5 s leases lapses meanwhile, on a machine 5x slower too; the last one
    # is left to lapse and waited for.
    log = redis_log(redis_url, ttl_s=30.0, lease_s=0.5, follow_wait_s=0.1)
    await log.claim_reader("s3", "t1")
    assert await log.renew_reader("s3", "t1")
    await log.claim_reader("s3", "t2")  # a newer reader takes it over
    assert not await log.renew_reader("s3", "t1")  # the old one finds it lost
    assert await log.renew_reader("s3", "t2")
    log.release_reader("s3", "t1")  # not its lease any more: nothing happens
    await log.flush()
    assert await log.reader_held("s3")
    log.release_reader("s3", "t2")
    await log.flush()
    assert not await log.reader_held("s3")
    assert not await log.renew_reader("s3", "t2")  # released: not taken again
    await log.claim_reader("s3", "t3")
    with trio.fail_after(START_TIMEOUT_S):  # not renewed: it lapses
        while await log.reader_held("s3"):  # noqa: ASYNC110 (Redis's clock)
            await trio.sleep(0.05)


# -- two replicas, one Redis ------------------------------------------------------------

async def test_a_stream_cut_on_one_replica_resumes_on_the_other_exactly(
    start_server: StartServer, redis_url: str,
) -> None:
    a, b = await two_replicas(start_server, redis_url)
    async with a.client() as client:
        whole = parse((await client.post("/v1/stream", json=short_body())).content)
    expected, num_events = token_ids(whole), len(whole)

    for k in (1, 2, 7, num_events - 1):
        request_id, received = await cut_after(a.host, a.port, lambda _: a, short_body(), k)
        response = await get_resume(b.base_url, request_id, f"{request_id}:{k}")
        rest = parse(response.content)

        assert response.status_code == 200, (k, response.content)
        assert positions(received + rest, request_id) == list(range(1, num_events + 1)), k
        assert token_ids(received + rest) == expected, k
        assert rest[-1].event == "done"
        assert holding(b, request_id) is Holding.GONE  # B never owned it
    b_stats = b.app.runtime.statistics()
    assert (b_stats["resumes"], b_stats["resumable_streams"]) == (4, 0)


async def test_a_remote_reader_keeps_the_stream_past_the_grace_period(
    start_server: StartServer, redis_url: str,
) -> None:
    """The owner's grace runs out while B follows: the lease makes it go on."""
    # A's steps are held from the start, so the stream is still running when its grace
    # period runs out, however fast the machine; B takes the lease milliseconds after the
    # 201, well inside the 1 s grace on a machine 5x slower. The test waits for the
    # grace's end itself: the registry starts another grace period (the lease is held).
    tokens = 32
    a, b = await two_replicas(start_server, redis_url, resume_grace_s=1.0)
    body = stream_body(max_new_tokens=tokens, ignore_eos=True)
    store = redis.Redis.from_url(redis_url)
    a.recorder.hold()
    async with a.client() as client:
        request_id = (await client.post("/v1/requests", json=body)).json()["id"]
    registry = a.app.runtime.resumption
    assert registry is not None
    entry = registry._local.get(request_id)  # tests may use internals: the grace's scope
    assert entry is not None and entry.holder is not None
    first_grace = entry.holder.scope
    answers: list[httpx.Response] = []

    async def follow_on_b() -> None:
        answers.append(await get_resume(b.base_url, request_id, None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow_on_b)
        await a.wait_for(lambda: bool(store.exists(reader_key(request_id))), "B's lease")
        assert entry.holder is not None
        assert entry.holder.scope is first_grace  # B came within the first grace period
        await a.wait_for(lambda: (entry.holder and entry.holder.scope) is not first_grace
                         or entry.holding is Holding.GONE, "the grace period to run out")
        assert entry.holding is Holding.DETACHED  # not expired: another grace period
        a.recorder.release()
    store.close()
    events = parse(answers[0].content)

    assert positions(events, request_id) == list(range(1, tokens + 3))
    assert events[-1].event == "done"
    assert token_ids(events) == a.recorder.token_ids_of(request_id)
    finish = await a.wait_finished(request_id)
    assert finish.reason is FinishReason.LENGTH
    assert a.app.runtime.statistics()["resume_expiries"] == 0


def taken_over(events: list[ServerSentEvent]) -> bool:
    """Whether the body ended with the ``taken_over`` error event."""
    return bool(events) and events[-1].event == "error" and \
        json.loads(events[-1].data)["error"]["type"] == "taken_over"


async def test_a_resume_on_the_owner_takes_over_a_remote_reader_and_delete_ends_it_everywhere(
    start_server: StartServer, redis_url: str,
) -> None:
    a, b = await two_replicas(start_server, redis_url)
    request_id, _ = await cut_after(a.host, a.port, lambda _: a, long_body(), 2)

    async with b.client() as client, client.stream(
        "GET", f"/v1/stream/{request_id}", headers={"Last-Event-ID": f"{request_id}:2"}
    ) as remote:
        chunks = remote.aiter_bytes()  # kept: a dropped iterator closes the response
        first = await chunks.__anext__()  # B follows the shared log now, holding the lease
        async with a.client() as client_a, client_a.stream(
            "GET", f"/v1/stream/{request_id}", headers={"Last-Event-ID": f"{request_id}:2"}
        ) as local:
            status_on_a = local.status_code
            on_a = await read_events(local, 5)
            # Held until B found its lease taken (at its next renewal, a timer): the stream
            # cannot end first, however fast the machine, and B read no final event.
            a.recorder.hold()
            with trio.fail_after(START_TIMEOUT_S):  # B finds its lease taken at a renewal
                rest = first + b"".join([chunk async for chunk in chunks])
            deleted = await client_a.delete(f"/v1/requests/{request_id}")
            a.recorder.release()
    store = redis.Redis.from_url(redis_url)
    await a.wait_for(lambda: not store.exists(events_key(request_id)), "the log deleted")
    gone_on_b = await get_resume(b.base_url, request_id, None)
    store.close()

    assert status_on_a == 200
    assert positions(on_a, request_id) == [3, 4, 5, 6, 7]
    assert taken_over(parse(rest))
    assert (deleted.status_code, gone_on_b.status_code) == (204, 204)
    assert (await a.wait_finished(request_id)).reason is FinishReason.CANCELLED


async def test_a_finished_stream_expires_from_redis_after_the_grace_period(
    start_server: StartServer, redis_url: str,
) -> None:
    # The look at the store right after the response is a round trip or two: well inside
    # the 0.3 s grace on a machine 5x slower. Then the test waits for the log to go.
    a, b = await two_replicas(start_server, redis_url, resume_grace_s=0.3)
    async with a.client() as client:
        response = await client.post("/v1/stream", json=short_body(resumable=True))
    request_id = response.headers["X-Request-ID"]
    store = redis.Redis.from_url(redis_url)
    assert store.exists(events_key(request_id)) or await _flushed(a, store, request_id)

    await a.wait_for(lambda: not store.exists(events_key(request_id)), "the log expired")
    gone = await get_resume(b.base_url, request_id, f"{request_id}:3")
    store.close()

    assert gone.status_code == 204
    assert a.app.runtime.statistics()["resumable_streams"] == 0


async def _flushed(server: RunningServer, store: redis.Redis, request_id: str) -> bool:
    await server.wait_for(lambda: bool(store.exists(events_key(request_id))),
                          "the log written to Redis")
    return True


# -- through HAProxy -------------------------------------------------------------------

async def test_resume_through_haproxy_gives_the_uninterrupted_tokens(
    start_server: StartServer, redis_url: str,
    haproxy: Callable[[RunningServer, RunningServer], str],
) -> None:
    a, b = await two_replicas(start_server, redis_url)
    base_url = haproxy(a, b)
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    await wait_ready_through(base_url)
    async with httpx.AsyncClient(base_url=base_url, timeout=START_TIMEOUT_S) as client:
        whole = parse((await client.post("/v1/stream", json=short_body())).content)
    expected, num_events = token_ids(whole), len(whole)

    def owner(request_id: str) -> RunningServer:
        return a if holding(a, request_id) is not Holding.GONE else b

    remote = 0
    for k in (1, 3, 5, 8, 10, 13):
        request_id, received = await cut_after(host, int(port), owner, short_body(), k)
        own = owner(request_id)
        resumes_before = own.app.runtime.statistics()["resumes"]
        response = await get_resume(base_url, request_id, f"{request_id}:{k}")
        rest = parse(response.content)
        remote += own.app.runtime.statistics()["resumes"] == resumes_before

        assert response.status_code == 200, (k, response.content)
        assert positions(received + rest, request_id) == list(range(1, num_events + 1)), k
        assert token_ids(received + rest) == expected, k
    # leastconn round-robins replicas of equal load: some resumes landed on the other.
    assert remote > 0


async def wait_ready_through(base_url: str) -> None:
    """Until HAProxy answers /ready (the replicas were ready before it started, and
    HAProxy counts a server UP until its checks fail)."""
    with trio.fail_after(START_TIMEOUT_S):
        while True:
            try:
                async with httpx.AsyncClient(base_url=base_url) as client:
                    if (await client.get("/ready")).status_code == 200:
                        return
            except httpx.TransportError:
                pass
            await trio.sleep(0.05)


async def test_without_redis_the_owner_still_serves_and_others_answer_503(
    start_server: StartServer, own_redis: tuple[str, Callable[[], None]],
) -> None:
    """Redis dies: the owner streams and resumes from its local copy as it would alone
    (its writer retries); another replica refuses the resume with a retryable 503."""
    url, kill_redis = own_redis
    a, b = await two_replicas(start_server, url)
    kill_redis()

    async with a.client() as client:
        whole = parse((await client.post("/v1/stream", json=short_body())).content)
    request_id, received = await cut_after(a.host, a.port, lambda _: a, short_body(), 3)
    elsewhere = await get_resume(b.base_url, request_id, f"{request_id}:3")
    here = await get_resume(a.base_url, request_id, f"{request_id}:3")
    rest = parse(here.content)

    assert elsewhere.status_code == 503
    assert elsewhere.json()["error"]["type"] == "unavailable"
    assert elsewhere.headers["Retry-After"] == "1"
    assert here.status_code == 200
    assert token_ids(received + rest) == token_ids(whole)
    assert positions(received + rest, request_id) == list(range(1, len(whole) + 1))



async def test_concurrent_resumes_on_other_replicas_leave_the_newest_reader(
    start_server: StartServer, redis_url: str,
) -> None:
    """4 simultaneous resumes: each takes the lease over; the 3 that lost it find it
    at their next renewal and end with ``taken_over``; the one left reads on, gap-free."""
    a, b = await two_replicas(start_server, redis_url)
    request_id, _ = await cut_after(a.host, a.port, lambda _: a, long_body(), 2)
    # Held until three readers found their lease taken (each at its next renewal, a
    # timer): the stream cannot end first, however fast the machine.
    a.recorder.hold()
    statuses: list[int] = []
    bodies: list[list[ServerSentEvent]] = []
    three_ended = trio.Event()

    async def resume_once() -> None:
        async with b.client() as client, client.stream(
            "GET", f"/v1/stream/{request_id}", headers={"Last-Event-ID": f"{request_id}:2"}
        ) as response:
            statuses.append(response.status_code)
            bodies.append(parse(b"".join([chunk async for chunk in response.aiter_bytes()])))
        if sum(taken_over(body) for body in bodies) == 3:
            three_ended.set()

    with trio.fail_after(START_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(resume_once)
            await three_ended.wait()
            a.recorder.release()  # the newest reads on until the DELETE
            async with a.client() as client:
                await client.delete(f"/v1/requests/{request_id}")

    assert statuses == [200] * 4
    newest = next(body for body in bodies if not taken_over(body))
    assert positions(newest, request_id) == list(range(3, 3 + len(newest)))
    assert token_ids(newest) == a.recorder.token_ids_of(request_id)[1:1 + len(newest)]


async def read_events(response: httpx.Response, count: int) -> list[ServerSentEvent]:
    """The first ``count`` events of a streamed response (iterating its body)."""
    parser, events = SSEParser(), []
    async for chunk in response.aiter_bytes():
        events += parser.feed(chunk)
        if len(events) >= count:
            break
    return events[:count]


async def test_a_reader_on_another_replica_takes_over_a_silently_dead_one_on_the_owner(
    start_server: StartServer, redis_url: str,
) -> None:
    """The owner's reader stops reading and never closes (no FIN, no RST): a resume on
    B gets the stream at once; the owner's reader finds the lease taken at its next
    renewal, gets no more events (its body ends with ``taken_over``), and lets go."""
    a, b = await two_replicas(start_server, redis_url)
    first = RawClient(a.host, a.port)
    await first.post("/v1/stream", {**long_body(), "resumable": True})
    await first.read_tokens(2)  # from now on it reads nothing and stays open
    request_id = first.request_id()
    k = len(first.events)
    store = redis.Redis.from_url(redis_url)
    await a.wait_for(lambda: bool(store.exists(reader_key(request_id))), "the lease set")

    # At once: milliseconds, on a machine 5x slower too, where a dead reader left alone is
    # dropped only after the 10 s stall timeout.
    with trio.fail_after(2.0):
        async with b.client() as client, client.stream(
            "GET", f"/v1/stream/{request_id}", headers={"Last-Event-ID": f"{request_id}:{k}"}
        ) as second:
            status = second.status_code
            taken = await read_events(second, 10) if status == 200 else []
            # The first finds the lease taken at its renewal: on the first item it takes
            # LEASE_CHECK_S (0.25 s) after the last, so the stream must go on that long.
            # Paced, its 400-odd tokens left take 4 s at least, however fast the machine.
            a.recorder.pace(0.01)
    await first.read_to_end()  # what A wrote to the first, all buffered
    a.recorder.pace(0)
    first.sock.close()
    await a.wait_for(lambda: holding(a, request_id) is Holding.DETACHED, "the first let go")
    async with a.client() as client:
        deleted = await client.delete(f"/v1/requests/{request_id}")
    store.close()

    assert status == 200
    assert positions(taken, request_id) == list(range(k + 1, k + 11))
    assert token_ids(taken) == a.recorder.token_ids_of(request_id)[k - 1:k + 9]
    numbered = first.events[:-1]
    assert positions(numbered, request_id) == list(range(1, len(numbered) + 1))
    assert taken_over(first.events)
    assert deleted.status_code == 204
    assert (await a.wait_finished(request_id)).reason is FinishReason.CANCELLED

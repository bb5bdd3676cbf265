"""The store's writer bounded and atomic, and DELETE on any replica (issue 23, items 7, 8).

Real ``redis-server`` processes (``tests/test_replicas.py``'s fixtures); the replicas are
in-process hypercorn servers on the tiny model (``tests/http_server.py``), read over real
HTTP. Before the fixes: the writer's queue grew without bound while Redis was away (a
stream went on as if nothing happened, its commands piling up in memory), an XADD and
its key's PEXPIRE were separate commands, so a connection cut between them left a key
that never expires, and ``DELETE /v1/requests/<id>`` on a replica that does not own the
stream answered 404 while the stream kept generating on its owner.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
import redis
import trio
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine import FinishReason
from streams.resume import Holding, RedisEventLog
from streams.resume.redis_keys import events_key, spec_key, writer_key
from tests.http_clients import long_body
from tests.http_server import RunningServer, StartServer
from tests.test_replicas import (  # noqa: F401 (own_redis, redis_process, redis_url: fixtures)
    RESUME_SECRET,
    get_resume,
    holding,
    own_redis,
    parse,
    redis_process,
    redis_url,
    two_replicas,
)

QUEUE = 32  # resume_store_queue in the outage test: a stream passes it in a few steps


@pytest.fixture
def store(redis_url: str) -> Iterator[redis.Redis]:  # noqa: F811
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


async def stats(server: RunningServer) -> tuple[dict[str, object], dict[str, float]]:
    """/stats, and /metrics' counters by name."""
    async with server.client() as client:
        current = (await client.get("/stats")).json()
        text = (await client.get("/metrics")).text
    counters = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("streamscope_resume") and line.split()[0].endswith("_total")}
    return current, counters


# -- item 7: a bounded queue, atomic batches ---------------------------------------------

async def test_a_store_that_stops_mid_stream_ends_the_stream_with_an_error_and_counts_it(
    start_server: StartServer, own_redis: tuple[str, Callable[[], None]],  # noqa: F811
) -> None:
    """Redis is killed while a resumable stream is read: once ``resume_store_queue``
    commands wait, the stream ends with ``error`` ``unavailable`` (its blocks released)
    instead of its commands piling up; /stats and /metrics say what happened."""
    # Paced: 480 tokens take 4.8 s at least, so the stream still runs at the kill, and the
    # QUEUE commands it then queues come within half a second, however fast the machine.
    url, kill_redis = own_redis
    server = await start_server(resume_store=url, resume_secret=RESUME_SECRET,
                                resume_store_queue=QUEUE)
    server.recorder.pace(0.01)
    async with server.client() as client, client.stream(
        "POST", "/v1/stream", json=long_body(resumable=True)) as response:
        request_id = response.headers["X-Request-ID"]
        chunks = response.aiter_bytes()
        raw = await chunks.__anext__()
        while raw.count(b"event: token") < 3:
            raw += await chunks.__anext__()
        kill_redis()  # mid-stream
        raw += b"".join([chunk async for chunk in chunks])
    events = parse(raw)
    finish = await server.wait_finished(request_id)
    current, counters = await stats(server)

    assert events[-1].event == "error"
    error = json.loads(events[-1].data)["error"]
    assert error["type"] == "unavailable" and "STREAMSCOPE_RESUME_STORE" in error["message"]
    assert finish.reason is FinishReason.CANCELLED and finish.completion_tokens < 480
    assert current["resume_store_cut_streams"] == 1
    assert counters["streamscope_resume_store_cut_streams_total"] == 1
    assert isinstance(current["resume_store_pending"], int)
    assert current["resume_store_pending"] <= QUEUE  # bounded
    assert current["resume_store_failed_batches"] >= 1  # type: ignore[operator]
    assert counters["streamscope_resume_store_failed_batches_total"] >= 1


class CuttingProxy:
    """A TCP proxy in front of Redis: the first connection's first ``limit`` bytes go
    through, then both sides are cut and no other connection is taken (Redis is gone).
    Threads: one accepts, one pumps each way."""

    def __init__(self, upstream_port: int, limit: int) -> None:
        self._upstream_port = upstream_port
        self._limit = limit
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.cut = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self._listener.accept()
        self._listener.close()  # nothing after: connections are refused
        upstream = socket.create_connection(("127.0.0.1", self._upstream_port))
        threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()
        forwarded = 0
        while forwarded < self._limit:
            data = client.recv(65536)
            if not data:
                break
            data = data[:self._limit - forwarded]
            upstream.sendall(data)
            forwarded += len(data)
        for sock in (upstream, client):
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.cut.set()

    @staticmethod
    def _answers(upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass  # cut


async def test_a_batch_cut_mid_way_leaves_no_key_without_its_time_to_live(
    redis_url: str, store: redis.Redis,  # noqa: F811
) -> None:
    """The connection to Redis breaks in the middle of a batch of 300 streams' appends:
    what landed has its time to live (before: the first half's XADDs landed, their
    PEXPIREs, at the batch's end, never did, and those keys would never expire)."""
    proxy = CuttingProxy(int(urlsplit(redis_url).port or 6379), limit=20_000)
    client = redis.Redis(host="127.0.0.1", port=proxy.port, retry=Retry(NoBackoff(), 0))
    log = RedisEventLog(client, secret=RESUME_SECRET, ttl_s=30.0)
    for s in range(300):  # about 60 KB of commands: the cut comes a third of the way in
        log.append(f"cut-{s}", 1, b"x" * 100)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.flush)  # tried again forever: cancelled below
        with trio.fail_after(10):
            while log.statistics().failed_batches == 0:  # noqa: ASYNC110 (a thread's)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert proxy.cut.is_set()
    await trio.sleep(0.2)  # for Redis to have run whatever reached it before the cut
    keys = store.keys("streamscope:{cut-*")

    assert [key for key in keys if store.pttl(key) < 0] == []


async def test_the_writer_s_queue_stays_bounded_while_redis_does_not_answer(
    own_redis: tuple[str, Callable[[], None]],  # noqa: F811
) -> None:
    """On the log alone: past ``max_pending`` a stream is cut (``StoreFull`` once, then
    its local copy only), other commands are dropped, and all of it is counted."""
    from streams.resume.errors import StoreFull

    url, kill_redis = own_redis
    kill_redis()
    log = RedisEventLog.from_url(url, secret=RESUME_SECRET, ttl_s=30.0, max_pending=4)
    for n in range(1, 5):
        log.append("s1", n, b"event")
    with pytest.raises(StoreFull):
        log.append("s1", 5, b"event")
    log.append("s1", 5, b"error", last=True)  # its copy here only
    log.release_reader("s1", "token")  # dropped
    with pytest.raises(StoreFull):
        log.append("s2", 1, b"start")
    stats = log.statistics()

    assert log.read_after("s1", 0) == [b"event"] * 4 + [b"error"]
    assert (stats.pending, stats.cut_streams, stats.dropped) == (4, 2, 1)


# -- item 8: DELETE on a replica that does not own the stream --------------------------

async def test_delete_on_a_replica_that_does_not_own_the_stream_cancels_it_there(
    start_server: StartServer, redis_url: str, store: redis.Redis,  # noqa: F811
) -> None:
    # A renews its leases, and looks for cancel marks, every 0.2 s (a third of its owner
    # lease); paced, its stream of 480 tokens runs 4.8 s at least, long after the DELETE.
    a, b = await two_replicas(start_server, redis_url, writer_lease_s=0.6)
    a.recorder.pace(0.01)
    async with a.client() as client:
        request_id = (await client.post("/v1/requests", json=long_body())).json()["id"]
    async with b.client() as client:
        deleted = await client.delete(f"/v1/requests/{request_id}")
    finish = await a.wait_finished(request_id)
    await a.wait_for(lambda: not store.exists(events_key(request_id)), "its keys deleted")
    gone = await get_resume(b.base_url, request_id, None)

    assert deleted.status_code == 204
    assert finish.reason is FinishReason.CANCELLED and finish.completion_tokens < 480
    assert holding(a, request_id) is Holding.GONE
    assert a.app.runtime.statistics()["resume_cancels"] == 1
    assert b.app.runtime.statistics()["resume_remote_cancels"] == 1
    assert gone.status_code == 204


async def test_delete_of_a_stream_whose_owner_is_gone_deletes_it_and_nobody_takes_it_over(
    start_server: StartServer, redis_url: str, store: redis.Redis,  # noqa: F811
) -> None:
    a, b = await two_replicas(start_server, redis_url)
    a.recorder.hold()
    async with a.client() as client:
        request_id = (await client.post("/v1/requests", json=long_body())).json()["id"]
    registry = a.app.runtime.resumption
    assert registry is not None and await registry.hand_over() == 1  # A lets it go
    a.recorder.release()
    async with b.client() as client:
        deleted = await client.delete(f"/v1/requests/{request_id}")
        unknown = await client.delete(f"/v1/requests/{'0' * 32}")
    gone = await get_resume(b.base_url, request_id, None)

    assert deleted.status_code == 204
    assert not store.exists(events_key(request_id), spec_key(request_id),
                            writer_key(request_id))
    assert gone.status_code == 204  # not rebuilt
    assert b.recorder.submitted == []
    assert unknown.status_code == 404

"""Stored responses (``app/runtime/responses_store.py``): the per-key bounds, the time to
live, and in Redis the signature, against a real ``redis-server``; and the bound as a
client meets it over HTTP (429 ``too_many_stored`` before anything runs). The record
(``app/runtime/stored_response.py``) and the one Redis client and signer the store shares
with the resume log: ``tests/test_responses_record.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis
import trio
import trio.testing

from app.runtime import OutputParsing, StoredResponse
from app.runtime.responses_store import (
    KEY_PREFIX,
    MemoryResponses,
    RedisResponses,
    ResponsesFull,
    ResponseStore,
    StoreBounds,
)
from engine.model import LoadedModel
from streams.resume import RedisStore
from tests import test_openai_sdk
from tests.http_server import StartServer
from tests.test_replicas import (  # noqa: F401 (redis_process, redis_url: fixtures)
    RESUME_SECRET,
    redis_process,
    redis_url,
)
from tests.test_responses_sdk import MODEL, serve

sdk = test_openai_sdk.sdk  # the fixture: an AsyncOpenAI client of a server

# Ten times the sizes of the untyped documents these tests began with: a record's JSON
# form carries its six fields (about 130 bytes) where those carried one.
BOUNDS = StoreBounds(ttl_s=60.0, max_count=2, max_bytes=2000)


def doc(owner: str, response_id: str, size: int) -> StoredResponse:
    """A record of ``owner``'s, ``size`` bytes as stored (at least its fields' bytes)."""
    def record(padding: str) -> StoredResponse:
        return StoredResponse(created={}, response={"id": response_id, "x": padding},
                              input_items=(), context=(), owner=owner,
                              parser=OutputParsing())

    return record("a" * max(0, size - len(record("").to_json())))


async def check_bounds(store: ResponseStore) -> None:
    await store.put(doc("k", "r1", 600))
    await store.put(doc("k", "r2", 600))
    with pytest.raises(ResponsesFull, match="at most 2 responses"):
        await store.put(doc("k", "r3", 100))  # a third: the count
    await store.put(doc("other", "r3", 600))  # another key's bound is its own
    await store.put(doc("k", "r2", 1200))  # a replacement counts once
    with pytest.raises(ResponsesFull):
        await store.put(doc("k", "r2", 1500))  # 600 + 1500 > 2000: the bytes
    assert await store.get("r2") == doc("k", "r2", 1200)  # nothing written
    assert await store.delete("k", "r1")
    assert not await store.delete("k", "r1")
    await store.put(doc("k", "r4", 600))  # room again
    assert await store.get("r1") is None


async def test_memory_store_bounds_each_key(autojump_clock: trio.testing.MockClock) -> None:
    await check_bounds(MemoryResponses(BOUNDS))


async def test_memory_store_forgets_after_the_time_to_live(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryResponses(BOUNDS)
    await store.put(doc("k", "r1", 600))
    await store.put(doc("k", "r2", 600))

    await trio.sleep(BOUNDS.ttl_s)

    assert await store.get("r1") is None
    await store.put(doc("k", "r3", 600))  # the expired ones count no more
    await store.put(doc("k", "r4", 600))


async def test_redis_store_bounds_each_key_and_checks_its_signature(
    redis_url: str,  # noqa: F811 (the fixture)
) -> None:
    store = RedisResponses(RedisStore.from_url(redis_url, secret=RESUME_SECRET), BOUNDS)
    await check_bounds(store)
    client = redis.Redis.from_url(redis_url)
    ttl_ms = client.pttl(f"{KEY_PREFIX}r4")
    stored = client.get(f"{KEY_PREFIX}r4")
    assert stored is not None and 0 < ttl_ms <= BOUNDS.ttl_s * 1000

    signature, data = stored[:67], stored[67:]  # "2:<64 hex digits>:" then the record
    client.set(f"{KEY_PREFIX}r4", signature + data.replace(b"aaa", b"bbb"))
    forged = RedisResponses(RedisStore.from_url(redis_url,
                                                secret="another-secret-" + "x" * 32), BOUNDS)

    assert await store.get("r4") is None  # the document does not match its MAC
    await store.put(doc("k2", "r5", 600))
    assert await forged.get("r5") is None  # written with another secret
    client.close()


async def test_a_key_past_its_bound_is_refused_before_anything_runs(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any,
) -> None:
    server = await serve(start_server, tiny_model, responses_max_stored=2)
    client, _ = sdk(server)
    for _ in range(2):
        await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    submitted = list(server.recorder.submitted)

    with pytest.raises(openai.RateLimitError) as caught:
        await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                      stream=True)
    unstored = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                             store=False)

    assert caught.value.code == "too_many_stored" and caught.value.param == "store"
    assert server.recorder.submitted == [*submitted, unstored.id.removeprefix("resp_")]

"""Stored responses (``app/runtime/responses_store.py``): the per-key bounds, the time to
live, and in Redis the signature, against a real ``redis-server``; and the bound as a
client meets it over HTTP (429 ``too_many_stored`` before anything runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis
import trio
import trio.testing

from app.runtime.responses_store import (
    KEY_PREFIX,
    MemoryResponses,
    RedisResponses,
    ResponsesFull,
    ResponseStore,
    StoreBounds,
)
from engine.model import LoadedModel
from tests import test_openai_sdk
from tests.http_server import StartServer
from tests.test_replicas import (  # noqa: F401 (redis_process, redis_url: fixtures)
    RESUME_SECRET,
    redis_process,
    redis_url,
)
from tests.test_responses_sdk import MODEL, serve

sdk = test_openai_sdk.sdk  # the fixture: an AsyncOpenAI client of a server

BOUNDS = StoreBounds(ttl_s=60.0, max_count=2, max_bytes=200)


def doc(size: int) -> dict[str, Any]:
    """A document of about ``size`` bytes as stored."""
    return {"response": {"x": "a" * (size - 21)}}


async def check_bounds(store: ResponseStore) -> None:
    await store.put("k", "r1", doc(60))
    await store.put("k", "r2", doc(60))
    with pytest.raises(ResponsesFull, match="at most 2 responses"):
        await store.put("k", "r3", doc(10))  # a third: the count
    await store.put("other", "r3", doc(60))  # another key's bound is its own
    await store.put("k", "r2", doc(120))  # a replacement counts once
    with pytest.raises(ResponsesFull):
        await store.put("k", "r2", doc(150))  # 60 + 150 > 200: the bytes
    assert await store.get("r2") == doc(120)  # nothing written
    assert await store.delete("k", "r1")
    assert not await store.delete("k", "r1")
    await store.put("k", "r4", doc(60))  # room again
    assert await store.get("r1") is None


async def test_memory_store_bounds_each_key(autojump_clock: trio.testing.MockClock) -> None:
    await check_bounds(MemoryResponses(BOUNDS))


async def test_memory_store_forgets_after_the_time_to_live(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryResponses(BOUNDS)
    await store.put("k", "r1", doc(60))
    await store.put("k", "r2", doc(60))

    await trio.sleep(BOUNDS.ttl_s)

    assert await store.get("r1") is None
    await store.put("k", "r3", doc(60))  # the expired ones count no more
    await store.put("k", "r4", doc(60))


async def test_redis_store_bounds_each_key_and_checks_its_signature(
    redis_url: str,  # noqa: F811 (the fixture)
) -> None:
    store = RedisResponses(redis_url, RESUME_SECRET, BOUNDS)
    await check_bounds(store)
    client = redis.Redis.from_url(redis_url)
    ttl_ms = client.pttl(f"{KEY_PREFIX}r4")
    stored = client.get(f"{KEY_PREFIX}r4")
    assert stored is not None and 0 < ttl_ms <= BOUNDS.ttl_s * 1000

    mac, _, data = stored.partition(b".")
    client.set(f"{KEY_PREFIX}r4", mac + b"." + data.replace(b"aaa", b"bbb"))
    forged = RedisResponses(redis_url, "another-secret-" + "x" * 32, BOUNDS)

    assert await store.get("r4") is None  # the document does not match its MAC
    await store.put("k2", "r5", doc(60))
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

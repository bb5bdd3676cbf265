"""Failover trusts nothing the shared store holds (issue 23, items 1 and 2).

Two replicas on the tiny model in this process (``tests/http_server.py``), one real
``redis-server`` (``tests/test_replicas.py``'s fixtures). A stream is made to change
hands by A's drain hand-over (``ResumeRegistry.hand_over``: A forgets it and lets its
owner lease go, exactly as before a death), or is written into Redis by the test itself
(someone who can write to the store, or a replica with another secret); then a
``GET /v1/stream/<id>`` on B asks B to take it over, over real HTTP.

Before the fix B ran whatever the store held: a spec written by anyone, a spec over
B's own limits, and it replayed any bytes stored as events to its readers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import trio

from app.settings import Settings, SettingsError
from streams import PolicyName, ServerSentEvent
from streams.resume import Holding, RedisEventLog
from streams.resume.redis_keys import events_key, spec_key, writer_key
from tests.http_clients import stream_body
from tests.http_server import RunningServer, StartServer
from tests.test_replicas import (  # noqa: F401 (redis_process, redis_url: fixtures)
    RESUME_SECRET,
    get_resume,
    holding,
    parse,
    positions,
    redis_log,
    redis_process,
    redis_url,
    token_ids,
    two_replicas,
)

TOKENS = 40  # with ignore_eos


@pytest.fixture
def store(redis_url: str) -> Iterator[redis.Redis]:  # noqa: F811
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


async def made_on_a_and_left(a: RunningServer, **fields: Any) -> str:
    """A resumable stream made on A (its steps held: it has not ended), then left to
    another replica by A's hand-over (A forgets it; its owner lease is let go)."""
    a.recorder.hold()
    async with a.client() as client:
        created = await client.post("/v1/requests", json=stream_body(
            max_new_tokens=TOKENS, ignore_eos=True, **fields))
    assert created.status_code == 201, created.content
    request_id: str = created.json()["id"]
    registry = a.app.runtime.resumption
    assert registry is not None
    assert await registry.hand_over() == 1
    a.recorder.release()
    return request_id


def refusal(events: list[ServerSentEvent], raw: bytes) -> str:
    """The message of the one error event a refused reader gets (and nothing else),
    which has no id (outside the stream's numbering, as ``taken_over``)."""
    assert [e.event for e in events] == ["error"], events
    block = raw[raw.rindex(b"event: error"):]
    assert b"\nid:" not in block and not block.startswith(b"id:")
    error = json.loads(events[0].data)["error"]
    assert error["type"] == "unavailable"
    message: str = error["message"]
    return message


async def counter(server: RunningServer, name: str) -> tuple[int, float]:
    """``name`` in /stats and its counter in /metrics."""
    async with server.client() as client:
        stats = (await client.get("/stats")).json()
        metrics = (await client.get("/metrics")).text
    line = next(line for line in metrics.splitlines()
                if line.startswith(f"streamscope_{name}_total "))
    return stats[name], float(line.split()[1])


# -- the secret --------------------------------------------------------------------------

def test_a_redis_store_without_its_secret_refuses_to_start_and_the_secret_is_never_shown(
) -> None:
    store_url = {"STREAMSCOPE_RESUME_STORE": "redis://127.0.0.1:6379/0"}
    with pytest.raises(SettingsError, match="STREAMSCOPE_RESUME_STORE needs "
                                            "STREAMSCOPE_RESUME_SECRET"):
        Settings.from_env(store_url)
    with pytest.raises(SettingsError, match=r"STREAMSCOPE_RESUME_SECRET: .*32") as short:
        Settings.from_env({**store_url, "STREAMSCOPE_RESUME_SECRET": "hunter2-too-short"})
    settings = Settings.from_env({**store_url, "STREAMSCOPE_RESUME_SECRET": RESUME_SECRET})

    assert "hunter2" not in str(short.value)
    assert settings.resume_secret == RESUME_SECRET
    assert RESUME_SECRET not in repr(settings) and RESUME_SECRET not in str(settings)


# -- item 1: the policy goes with the stream --------------------------------------------

async def test_a_rebuilt_stream_carries_its_request_policy(
    start_server: StartServer, redis_url: str,  # noqa: F811
) -> None:
    a, b = await two_replicas(start_server, redis_url)
    request_id = await made_on_a_and_left(a, policy="drop")  # the server's: pause-drop

    response = await get_resume(b.base_url, request_id, None)
    registry = b.app.runtime.resumption
    assert registry is not None
    entry = registry._local.get(request_id)  # tests may use internals: its TokenStream
    events = parse(response.content)

    assert response.status_code == 200
    assert positions(events, request_id) == list(range(1, TOKENS + 3))
    assert events[-1].event == "done"
    assert entry is not None and entry.stream.policy.name is PolicyName.DROP
    assert b.app.runtime.statistics()["resume_failovers"] == 1


# -- item 2: what anyone wrote to the store is not run ---------------------------------

def write_unsigned(store: redis.Redis, request_id: str) -> None:
    """A request written into the store by someone without the secret: a spec, and an
    event after which a rebuild would continue (no owner lease: it looks orphaned)."""
    store.set(spec_key(request_id), json.dumps(stream_body(max_new_tokens=TOKENS)))
    store.xadd(events_key(request_id), {"d": b"event: start\ndata: {}\n\n", "e": b"0"},
               id="0-1")


async def write_with_another_secret(url: str, request_id: str) -> None:
    """The same stream as a replica whose STREAMSCOPE_RESUME_SECRET differs writes it."""
    other = RedisEventLog.from_url(url, secret="another-" + RESUME_SECRET, ttl_s=30.0)
    spec = json.dumps(stream_body(max_new_tokens=TOKENS)).encode()
    other.publish(request_id, spec)
    other.append(request_id, 1, b"event: start\ndata: {}\n\n")
    await other.flush()
    other.release_writer(request_id)  # it died, say
    await other.flush()


def alter_spec(store: redis.Redis, request_id: str) -> None:
    """The signed spec of a real stream with one field changed, its HMAC left as it was."""
    stored = store.get(spec_key(request_id))
    assert isinstance(stored, bytes) and b'"max_new_tokens":40' in stored
    store.set(spec_key(request_id), stored.replace(b'"max_new_tokens":40',
                                                   b'"max_new_tokens":400'))


@pytest.mark.parametrize("forgery", ["unsigned", "another secret", "altered"])
async def test_a_request_written_into_the_store_is_not_run(
    start_server: StartServer, redis_url: str, store: redis.Redis,  # noqa: F811
    forgery: str,
) -> None:
    a, b = await two_replicas(start_server, redis_url)
    if forgery == "altered":
        request_id = await made_on_a_and_left(a)
        alter_spec(store, request_id)
    else:
        request_id = "f" * 32
        if forgery == "unsigned":
            write_unsigned(store, request_id)
        else:
            await write_with_another_secret(redis_url, request_id)

    response = await get_resume(b.base_url, request_id, None)

    assert response.status_code == 200
    assert "fails its HMAC" in refusal(parse(response.content), response.content)
    assert b.recorder.submitted == []  # nothing ran
    assert holding(b, request_id) is Holding.GONE
    await b.wait_for(lambda: not store.exists(writer_key(request_id)),
                     "the takeover's lease let go")  # queued: in B's next batch
    assert await counter(b, "resume_spec_rejected") == (1, 1.0)


SIGNED_BUT_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "max_new_tokens over the limit": ({"max_new_tokens": 501}, "max_new_tokens"),
    "too many stop strings": ({"stop": [f"s{i}" for i in range(9)]}, "stop"),
    "a stop string too long": ({"stop": ["x" * 65]}, "stop"),
    "a policy off the allow-list": ({"policy": "unbounded"}, "policy"),
    "a prompt too long": ({"prompt": "y" * 3001}, "prompt"),
    "a temperature out of range": ({"temperature": 1000.0}, "temperature"),
}


@pytest.mark.parametrize("case", sorted(SIGNED_BUT_REFUSED))
async def test_a_signed_spec_an_http_request_could_not_be_is_refused(
    start_server: StartServer, redis_url: str, case: str,  # noqa: F811
) -> None:
    """Signed with the replicas' own secret (a replica with other limits, or a bug): B
    still validates it as it would the request's body, and refuses it."""
    fields, what = SIGNED_BUT_REFUSED[case]
    _, b = await two_replicas(start_server, redis_url)
    writer, request_id = redis_log(redis_url, ttl_s=30.0), "e" * 32
    writer.publish(request_id, json.dumps({**stream_body(max_new_tokens=TOKENS),
                                           **fields}).encode())
    writer.append(request_id, 1, b"event: start\ndata: {}\n\n")
    writer.release_writer(request_id)
    await writer.flush()

    response = await get_resume(b.base_url, request_id, None)

    assert response.status_code == 200
    message = refusal(parse(response.content), response.content)
    assert "refused here" in message and what in message
    assert b.recorder.submitted == []
    assert await counter(b, "resume_spec_rejected") == (1, 1.0)


async def test_stored_tokens_that_say_no_token_ids_are_refused(
    start_server: StartServer, redis_url: str,  # noqa: F811
) -> None:
    _, b = await two_replicas(start_server, redis_url)
    writer, request_id = redis_log(redis_url, ttl_s=30.0), "d" * 32
    writer.publish(request_id, json.dumps(stream_body(max_new_tokens=TOKENS)).encode())
    writer.append(request_id, 1, b"event: start\ndata: {}\n\n")
    writer.append(request_id, 2, b'event: token\ndata: {"index":0,"id":-7,"text":""}\n\n')
    writer.release_writer(request_id)
    await writer.flush()

    response = await get_resume(b.base_url, request_id, None)

    assert "say no tokens" in refusal(parse(response.content), response.content)
    assert b.recorder.submitted == []


async def test_an_altered_event_never_reaches_a_reader_on_another_replica(
    start_server: StartServer, redis_url: str, store: redis.Redis,  # noqa: F811
) -> None:
    """A stream A generates (and holds, finished), read on B from the store: an event
    changed in Redis ends B's reader with the refusal instead of its bytes."""
    a, b = await two_replicas(start_server, redis_url)
    async with a.client() as client:
        created = await client.post("/v1/requests", json=stream_body(max_new_tokens=4,
                                                                     ignore_eos=True))
        request_id = created.json()["id"]
    await a.wait_finished(request_id)
    key = events_key(request_id)
    await a.wait_for(lambda: store.xlen(key) == 6, "the whole stream in Redis")
    entries: Any = store.xrange(key)
    store.delete(key)  # written again, event 3's bytes changed (its HMAC as it was)
    for entry_id, fields in entries:
        if entry_id == b"0-3":
            fields = {**fields, b"d": fields[b"d"].replace(b'"index":1', b'"index":7')}
        store.xadd(key, fields, id=entry_id)

    response = await get_resume(b.base_url, request_id, f"{request_id}:1")
    events = parse(response.content)

    assert response.status_code == 200
    assert [e.event for e in events[:1]] == ["token"]  # event 2, as A made it
    assert positions(events[:1], request_id) == [2]
    assert "event 3" in refusal(events[1:], response.content)
    assert b'"index":7' not in response.content
    assert await counter(b, "resume_events_rejected") == (1, 1.0)


async def test_a_stream_resumed_on_another_replica_still_reads_whole(
    start_server: StartServer, redis_url: str,  # noqa: F811
) -> None:
    """The checks refuse nothing a replica wrote: a rebuild on B continues A's stream
    with the tokens an uninterrupted run makes."""
    a, b = await two_replicas(start_server, redis_url)
    async with httpx.AsyncClient(base_url=a.base_url) as client:
        whole = parse((await client.post("/v1/stream", json=stream_body(
            max_new_tokens=TOKENS, ignore_eos=True))).content)
    request_id = await made_on_a_and_left(a)

    with trio.fail_after(30):
        response = await get_resume(b.base_url, request_id, None)
    events = parse(response.content)

    assert token_ids(events) == token_ids(whole)
    assert b.app.runtime.statistics()["resume_spec_rejected"] == 0

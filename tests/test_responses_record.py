"""A stored response as a typed record (``app/runtime/stored_response.py``), and the one
Redis client and signer the Responses store shares with the resume log
(``streams/resume/redis_store.py``), against a real ``redis-server``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
import trio
import trio.testing

from app.runtime import OutputParsing, StoredResponse
from app.runtime.responses_store import KEY_PREFIX, MemoryResponses, RedisResponses
from app.schemas.tool_formats import GENERIC, HERMES
from engine.model import LoadedModel
from streams.resume import RedisStore, StoreRejected
from tests import test_openai_sdk
from tests.http_server import StartServer
from tests.test_replicas import (  # noqa: F401 (redis_process, redis_url: fixtures)
    RESUME_SECRET,
    redis_process,
    redis_url,
)
from tests.test_responses_background import settled
from tests.test_responses_sdk import MODEL, serve
from tests.test_responses_store import BOUNDS

sdk = test_openai_sdk.sdk  # the fixture: an AsyncOpenAI client of a server

CREATED = {"id": "resp_abc", "object": "response", "status": "in_progress",
           "background": False, "store": True, "output": [], "metadata": {"k": "é\u2028"}}
RECORD = StoredResponse(
    created=CREATED,
    response={**CREATED, "status": "completed",
              "output": [{"id": "fc_abc_0", "type": "function_call", "name": "f"}]},
    input_items=({"id": "msg_abc_in0", "role": "user", "content": "Hi"},),
    context=({"role": "user", "content": "before"}, {"role": "user", "content": "Hi"}),
    owner="team-a",
    parser=OutputParsing(logprobs=False, call_prefix="call_abc"),
)


def test_a_record_is_read_back_from_its_json_form_as_it_was() -> None:
    data = RECORD.to_json()
    plain = StoredResponse.from_json(
        dataclasses.replace(RECORD, parser=OutputParsing(logprobs=True)).to_json())

    assert StoredResponse.from_json(data) == RECORD
    assert list(json.loads(data)) == ["created", "response", "input_items", "context",
                                      "owner", "parser"]
    assert json.loads(data)["parser"] == {"logprobs": False, "tools": "call_abc",
                                          "format": GENERIC}
    assert plain.parser == OutputParsing(logprobs=True, call_prefix=None)
    assert json.loads(plain.to_json())["parser"] == {"logprobs": True, "tools": False}
    assert (RECORD.id, RECORD.is_stored, RECORD.is_background) == ("resp_abc", True, False)
    with pytest.raises(ValueError):
        StoredResponse.from_json(b'{"created": {}}')  # fields missing
    with pytest.raises(ValueError):
        StoredResponse.from_json(data.replace(b'"input_items":[', b'"input_items":[1,'))


def test_a_record_keeps_its_calls_format_and_an_older_one_reads_as_generic() -> None:
    hermes = dataclasses.replace(RECORD, parser=OutputParsing(call_prefix="call_abc",
                                                              call_format=HERMES))
    older = json.loads(RECORD.to_json())
    del older["parser"]["format"]  # as records were stored before there were formats

    assert StoredResponse.from_json(hermes.to_json()).parser.call_format == HERMES
    assert StoredResponse.from_json(json.dumps(older).encode()).parser == RECORD.parser
    assert OutputParsing().call_format == GENERIC  # the runtime's name is the schemas'


def test_a_record_is_frozen_and_a_new_state_is_a_new_record() -> None:
    final = RECORD.with_response({**CREATED, "status": "cancelled"})

    with pytest.raises(AttributeError):
        RECORD.owner = "team-b"  # type: ignore[misc]
    assert final.response["status"] == "cancelled"
    assert RECORD.response["status"] == "completed"
    assert (final.created, final.context, final.owner) == (
        RECORD.created, RECORD.context, RECORD.owner)


async def test_the_memory_store_gives_back_an_equal_record_of_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryResponses(BOUNDS)
    await store.put(RECORD)

    back = await store.get(RECORD.id)

    assert back == RECORD
    assert back is not None and back.response is not RECORD.response


async def test_a_record_in_redis_is_signed_by_the_shared_signer_and_a_tampered_one_is_absent(
    redis_url: str,  # noqa: F811 (the fixture)
) -> None:
    shared = RedisStore.from_url(redis_url, secret=RESUME_SECRET)
    store = RedisResponses(shared, BOUNDS)
    client = redis.Redis.from_url(redis_url)
    await store.put(RECORD)
    stored = client.get(f"{KEY_PREFIX}{RECORD.id}")
    assert stored is not None
    assert shared.signer.open_value("response", RECORD.id, stored) == RECORD.to_json()
    assert await store.get(RECORD.id) == RECORD

    other = "resp_other"  # the same signed bytes under another response's id
    client.set(f"{KEY_PREFIX}{other}", stored)
    as_spec = shared.signer.sign_spec(RECORD.id, RECORD.to_json())  # signed as a spec
    with pytest.raises(StoreRejected):  # and a stored response is no spec to the log
        shared.signer.open_spec(RECORD.id, stored)
    client.set(f"{KEY_PREFIX}{RECORD.id}", as_spec)
    absent_spec = await store.get(RECORD.id)
    client.set(f"{KEY_PREFIX}{RECORD.id}", stored.replace(b"team-a", b"team-b"))
    absent_altered = await store.get(RECORD.id)
    client.set(f"{KEY_PREFIX}{RECORD.id}", RECORD.to_json())  # unsigned
    absent_unsigned = await store.get(RECORD.id)

    assert await store.get(other) is None
    assert (absent_spec, absent_altered, absent_unsigned) == (None, None, None)
    client.close()


async def test_the_responses_store_and_the_resume_log_share_one_client_and_signer(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any,
    redis_url: str,  # noqa: F811 (the fixture)
) -> None:
    server = await serve(start_server, tiny_model, resume_store=redis_url,
                         resume_secret=RESUME_SECRET)
    runtime = server.app.runtime
    shared = runtime.shared_store
    views = server.app.view_functions["responses.retrieve"].__self__  # type: ignore[attr-defined]
    store = views.adapter.store
    registry = runtime.resumption
    assert shared is not None and registry is not None
    client, _ = sdk(server)

    made = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=3,
                                         background=True)
    final = await settled(client, made.id)
    raw = redis.Redis.from_url(redis_url)
    stored = raw.get(f"{KEY_PREFIX}{made.id}")
    raw.close()

    assert final.status == "incomplete"
    assert isinstance(store, RedisResponses) and store.shared is shared
    log_client = registry._shared._client  # type: ignore[attr-defined]
    assert log_client is shared.client
    assert log_client.connection_pool is store.shared.client.connection_pool
    assert registry._shared._signer is shared.signer  # type: ignore[attr-defined]
    assert stored is not None and StoredResponse.from_json(
        shared.signer.open_value("response", made.id, stored)).id == made.id

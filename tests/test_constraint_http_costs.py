"""What a constraint may cost, over real HTTP (issue 43, items 1-3 and 6).

* The issue's 17-character regex and its kin, sent every way a client can (a native
  ``regex``, a string ``pattern`` in an OpenAI ``response_format`` or a tool's
  parameters, an Anthropic tool, a Responses ``text.format``), are refused before the
  stream with the route's envelope (it was accepted, and cost 50-150 ms of mask work
  per row per step); nothing is submitted.
* The compile slot: another key's cached constraint answers while a compile holds the
  slot (it queued behind it); a key's second compile waits for its first, and another
  key's goes first; past the bounded wait, 429 with ``Retry-After``.
* The cache is per tenant: a key compiles for itself what another key compiled.

Hypercorn on loopback, the tiny GPT-2 with a ChatML template, two API keys; the
engine's compiles can be held (``RecordingEngine.hold_compiles``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
import trio.testing

from app.errors import ApiError
from app.runtime.prompts import TokenizerQueue
from engine import Constraint, ConstraintKind
from tests.http_server import RecordingEngine, RunningServer, StartServer
from tests.tool_servers import MODEL, start_tool_server

if TYPE_CHECKING:
    from engine.model import LoadedModel

NESTED = "((a{60}){60}){60}"
PATTERNED = {"type": "object", "properties": {"a": {"type": "string", "pattern": NESTED}},
             "required": ["a"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Hi"}]
KEY_A = "sk-slot-a-0123456789abcdefghijklmnopqrs"
KEY_B = "sk-slot-b-0123456789abcdefghijklmnopqrs"
KEYS = [{"name": "a", "key": KEY_A}, {"name": "b", "key": KEY_B}]
WAIT_S = 30.0  # a safety net for what must not wait: the held compile never ends alone

HOSTILE = [
    ("/v1/stream", {"prompt": "A", "constraint": {"type": "regex", "pattern": NESTED}}, 422),
    ("/v1/stream", {"prompt": "A", "constraint": {
        "type": "regex", "pattern": "(((a{20}){20}){20}){20}"}}, 422),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": PATTERNED}}}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": PATTERNED}}]}, 400),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": QUESTION,
                      "tool_choice": {"type": "any"},
                      "tools": [{"name": "f", "input_schema": PATTERNED}]}, 400),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "s", "schema": PATTERNED}}}, 400),
]


@pytest.fixture
def loaded(tiny_model: Callable[[str], LoadedModel]) -> LoadedModel:
    return tiny_model("tiny-gpt2")


@pytest.mark.parametrize(("path", "body", "status"), HOSTILE,
                         ids=["regex", "deeper", "response_format", "tool", "anthropic",
                              "responses"])
async def test_a_nested_count_constraint_is_refused_before_the_stream(
    start_server: StartServer, loaded: LoadedModel, path: str, body: dict[str, Any],
    status: int,
) -> None:
    server = await start_tool_server(start_server, loaded)
    async with server.client() as client:
        stream = {} if path == "/v1/stream" else {"stream": True}
        response = await client.post(path, json={**body, **stream})
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "costs too much" in response.text
    if path != "/v1/messages":  # the native type, or the OpenAI routes' ``code``
        assert '"invalid_constraint"' in response.text, response.text
    assert server.recorder.submitted == []


async def _post(server: RunningServer, key: str, constraint: dict[str, Any]) -> httpx.Response:
    async with server.client() as client:
        return await client.post("/v1/generate", headers={"Authorization": f"Bearer {key}"},
                                 json={"prompt": "A", "max_new_tokens": 2,
                                       "constraint": constraint})


def _schema(n: int) -> dict[str, Any]:
    return {"type": "json_schema", "schema": {
        "type": "object", "properties": {f"p{n}": {"type": "integer"}}}}


async def test_a_cached_constraint_takes_no_slot_and_keys_take_turns(
    start_server: StartServer, loaded: LoadedModel,
) -> None:
    server = await start_tool_server(start_server, loaded, api_keys=KEYS)
    recorder = server.recorder
    assert (await _post(server, KEY_B, {"type": "json_object"})).status_code == 200
    recorder.hold_compiles()
    answers: dict[str, int] = {}

    async def send(name: str, key: str, constraint: dict[str, Any]) -> None:
        answers[name] = (await _post(server, key, constraint)).status_code

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "a1", KEY_A, _schema(1))
            await server.wait_for(lambda: len(recorder.compiles) == 2, "a1's compile")
            nursery.start_soon(send, "a2", KEY_A, _schema(2))
            await server.wait_for(lambda: _queued(server) == 1, "a2 to queue")
            nursery.start_soon(send, "b1", KEY_B, _schema(3))
            await server.wait_for(lambda: _queued(server) == 2, "b1 to queue")
            with trio.fail_after(WAIT_S):  # while a1's compile holds the slot
                cached = await _post(server, KEY_B, {"type": "json_object"})
            assert cached.status_code == 200
            recorder.release_compiles()
    finally:
        recorder.release_compiles()
    assert answers == {"a1": 200, "a2": 200, "b1": 200}
    order = [json.loads(c.source) for _, c in recorder.compiles[1:]]
    assert [list(s.get("properties", {})) for s in order] == [["p1"], ["p3"], ["p2"]]


def _queued(server: RunningServer) -> int:
    """Compiles waiting: for the slot, or for their key's turn."""
    queue = server.app.runtime._prompts
    turns = getattr(queue, "_turns", {})
    return int(queue._compiling.statistics().tasks_waiting) + sum(
        max(0, t.users - 1) for t in turns.values())


async def test_the_cache_is_per_tenant(start_server: StartServer, loaded: LoadedModel) -> None:
    server = await start_tool_server(start_server, loaded, api_keys=KEYS)
    constraints = server.recorder._engine._intake.constraints  # type: ignore[attr-defined]
    compiled = constraints.num_compiled
    for key in (KEY_A, KEY_A, KEY_B):
        assert (await _post(server, key, _schema(7))).status_code == 200
    assert constraints.num_compiled == compiled + 2  # A once, B once: B found nothing


async def test_a_compile_that_gets_no_turn_in_time_is_429(
    autojump_clock: trio.testing.MockClock, loaded: LoadedModel,
) -> None:
    from engine.engine import Engine

    engine = RecordingEngine(Engine(loaded, max_batch=2, num_blocks=16, block_size=16))
    engine.compile_constraint(Constraint(ConstraintKind.JSON_OBJECT))  # the tokenizer's
    queue = TokenizerQueue()
    queue.compile_wait_s = 5.0
    engine.hold_compiles()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.compile, engine, _constraint(1), b"a", "a")
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(60), pytest.raises(ApiError) as refused:
                await queue.compile(engine, _constraint(2), b"b", "b")
            engine.release_compiles()
    finally:
        engine.release_compiles()
    assert refused.value.status == 429
    assert refused.value.headers().get("Retry-After") == "1"


def _constraint(n: int) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(_schema(n)["schema"]))



async def test_a_refused_compile_makes_its_key_rest_and_no_other(
    autojump_clock: trio.testing.MockClock, loaded: LoadedModel,
) -> None:
    """A key's refused constraint (milliseconds of CPU, part under the interpreter's
    lock) makes its next compile wait, in proportion; another key's goes at once."""
    from engine import InvalidConstraint
    from engine.engine import Engine

    engine = RecordingEngine(Engine(loaded, max_batch=2, num_blocks=16, block_size=16))
    engine.compile_constraint(Constraint(ConstraintKind.JSON_OBJECT))  # the tokenizer's
    queue = TokenizerQueue()
    with pytest.raises(InvalidConstraint):
        await queue.compile(engine, Constraint(ConstraintKind.REGEX, NESTED), b"a", "a")
    started = trio.current_time()
    await queue.compile(engine, _constraint(1), b"b", "b")
    assert trio.current_time() == started
    await queue.compile(engine, _constraint(2), b"a", "a")
    assert trio.current_time() > started


async def test_a_keys_burst_of_chat_renders_holds_one_place_in_the_tokenizer_queue(
    loaded: LoadedModel,
) -> None:
    """Another key's encode waits for at most the one render running, not for the
    burst (a cached constrained request took 400 ms more behind 8 hostile chat
    requests' renders, in the lab)."""
    from engine import GenerationRequest
    from engine.engine import Engine
    from tests.test_openai_sdk import with_chat_template

    engine = RecordingEngine(Engine(with_chat_template(loaded), max_batch=2, num_blocks=16,
                                    block_size=16))
    queue = TokenizerQueue()
    long_prompt = "b" * 600  # over INLINE_ENCODE_CHARS: encoded in the thread
    engine.hold_renders()
    try:
        async with trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(queue.render_chat, engine,
                                   [{"role": "user", "content": f"a{n}"}], True, "a")
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(queue.encode, engine, GenerationRequest("b", long_prompt),
                               "b")
            await trio.testing.wait_all_tasks_blocked()
            engine.release_renders()
    finally:
        engine.release_renders()
    assert engine.tokenizer_calls == [("render", "a0"), ("encode", long_prompt),
                                      ("render", "a1"), ("render", "a2")]

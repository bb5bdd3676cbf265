"""The native API's ``constraint`` over real HTTP (hypercorn on loopback, tiny model).

The output of a constrained stream parses against its schema (or matches its regex);
a constraint that does not compile, or is too big, or malformed, is refused before the
first byte with the native envelope; the rebuild spec carries the constraint. Every
test ends with the fixture's checks: no stream open, cache whole, releases == admitted.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from app.schemas import RequestLimits, parse_generate_body
from engine import GenerationRequest
from streams.resume import spec_of, spec_parts
from tests.http_clients import parse_sse
from tests.http_server import RunningServer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "temperature", "unit"],
    "additionalProperties": False,
}


async def _stream(server: RunningServer, body: dict[str, Any]) -> tuple[httpx.Response, bytes]:
    async with server.client() as client, client.stream("POST", "/v1/stream",
                                                         json=body) as response:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    return response, raw


def _text_and_finish(raw: bytes) -> tuple[str, str]:
    events = parse_sse(raw)
    assert [e.event for e in events[:1]] == ["start"] and events[-1].event == "done", events
    text = "".join(json.loads(e.data)["text"] for e in events if e.event == "token")
    return text, json.loads(events[-1].data)["finish_reason"]


def _matches_schema(doc: Any) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"city", "temperature", "unit"}
            and isinstance(doc["city"], str) and len(doc["city"]) <= 12
            and isinstance(doc["temperature"], int) and -50 <= doc["temperature"] <= 60
            and doc["unit"] in ("celsius", "fahrenheit"))


async def test_a_streamed_json_schema_output_parses_against_the_schema(
        server: RunningServer) -> None:
    for seed, temperature in ((None, 0.0), (3, 0.9)):
        body = {"prompt": "The weather, as JSON:", "max_new_tokens": 60,
                "temperature": temperature, "seed": seed,
                "constraint": {"type": "json_schema", "schema": SCHEMA}}
        response, raw = await _stream(server, body)
        assert response.status_code == 200
        text, finish = _text_and_finish(raw)
        assert finish == "stop", text
        assert _matches_schema(json.loads(text)), text


async def test_generate_with_a_regex_and_a_grammar(server: RunningServer) -> None:
    async with server.client() as client:
        regex = await client.post("/v1/generate", json={
            "prompt": "A code:", "constraint": {"type": "regex", "pattern": "[A-Z]{2}-[0-9]{3}"}})
        grammar = await client.post("/v1/generate", json={
            "prompt": "Yes or no?", "constraint": {"type": "grammar",
                                                   "grammar": 'start: "yes" | "no"'}})
        anything = await client.post("/v1/generate", json={
            "prompt": "{", "max_new_tokens": 40, "constraint": {"type": "json_object"}})
    assert regex.status_code == grammar.status_code == anything.status_code == 200
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.json()["text"])
    assert grammar.json()["text"] in ("yes", "no")
    assert anything.json()["text"].startswith("{")


async def _refused(server: RunningServer, constraint: Any,
                   kind: str = "invalid_request") -> dict[str, Any]:
    response, raw = await _stream(server, {"prompt": "A", "constraint": constraint})
    assert response.status_code == 422, raw
    assert response.headers["content-type"].startswith("application/json")
    body = json.loads(raw)
    assert list(body) == ["error"] and body["error"]["type"] == kind, body
    message = body["error"]["message"]
    assert isinstance(message, str)
    return body


async def test_a_constraint_that_does_not_compile_is_refused_before_the_stream(
        server: RunningServer) -> None:
    bad_schema = await _refused(server, {"type": "json_schema", "schema": {"type": "frob"}},
                                "invalid_constraint")
    assert "does not compile" in bad_schema["error"]["message"]
    bad_regex = await _refused(server, {"type": "regex", "pattern": "(("}, "invalid_constraint")
    assert "does not compile" in bad_regex["error"]["message"]
    bad_grammar = await _refused(server, {"type": "grammar", "grammar": "start: ((("},
                                 "invalid_constraint")
    assert "does not compile" in bad_grammar["error"]["message"]
    await _refused(server, {"type": "frob"})
    await _refused(server, {"type": "regex", "pattern": "a", "extra": 1})
    await _refused(server, {"type": "json_schema", "schema": "not an object"})
    assert server.recorder.admitted() == set()


def test_a_constraint_over_the_size_limit_is_refused() -> None:
    limits = RequestLimits(1000, 100, 10, frozenset(), max_constraint_chars=20)
    fits = {"prompt": "p", "constraint": {"type": "regex", "pattern": "a" * 20}}
    parse_generate_body(json.dumps(fits).encode(), limits)
    over = {"prompt": "p", "constraint": {"type": "json_schema", "schema": SCHEMA}}
    with pytest.raises(ValidationError, match="over the limit of 20"):
        parse_generate_body(json.dumps(over).encode(), limits)


def test_the_rebuild_spec_carries_the_constraint() -> None:
    """A stream taken over on another replica is rebuilt with its constraint (its
    matcher then replays the tokens it made: tests/test_engine_constraints.py)."""
    limits = RequestLimits(1000, 100, 10, frozenset())
    for constraint in ({"type": "json_schema", "schema": SCHEMA}, {"type": "json_object"},
                       {"type": "regex", "pattern": "[a-z]+"},
                       {"type": "grammar", "grammar": 'start: "a"'}):
        # A limit given: the default (what the context leaves) is filled in by prepare.
        raw = json.dumps({"prompt": "p", "max_new_tokens": 5, "constraint": constraint}).encode()
        request = parse_generate_body(raw, limits).generation_request()
        body, _ = spec_parts(spec_of(request, None))  # the body, as the rebuilder reads it
        rebuilt: GenerationRequest = parse_generate_body(body, limits).generation_request()
        assert rebuilt.constraint == request.constraint is not None

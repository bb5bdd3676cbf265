"""``POST /v1/responses`` under the chat routes' caps, and its small refusals (issue 43,
item 6), over real HTTP (the tiny model with a ChatML template).

The messages, text-parts and characters caps (``max_chat_messages``,
``max_content_parts``, ``max_prompt_chars``) bound the whole conversation the chat
template renders: ``instructions``, a ``previous_response_id``'s stored turns and the
new input, refused with 400 before the template renders on the one tokenizer slot.

Before: the Responses body had no message or part cap (1,024 input items were rendered,
then refused as too long), a previous response's turns were added uncounted, a
``limit`` of 5,000 digits on ``input_items`` was a 500 with a traceback (``int()`` past
Python's int max str digits), and an unknown ``tool_choice`` function was named by its
template, ``{name!r}``, not by its name; a past call's ``arguments`` of 5,000 digits
came back as the interpreter's message (``json.loads`` raised a plain ValueError).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.test_responses_sdk import MODEL, serve


def turn(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


async def create(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await client.post("/v1/responses", json={
        "model": MODEL, "max_output_tokens": 2, "temperature": 0, **fields})


def assert_invalid(answer: httpx.Response, param: str | None, *words: str) -> None:
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


async def test_input_items_past_the_message_and_part_caps_are_refused_before_rendering(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server = await serve(start_server, tiny_model, max_content_parts=6,
                         max_body_bytes=1024 * 1024)
    parts = [{"type": "input_text", "text": "x"}] * 7
    async with server.client() as client:
        many = await create(client, input=[{"role": "user", "content": "Hi"}] * 1024)
        split = await create(client, input=[{"role": "user", "content": parts}])

    assert_invalid(many, None, "1024 messages", "limit of 512")
    assert_invalid(split, None, "7 text parts", "limit of 6")
    assert server.recorder.submitted == []


async def test_a_previous_responses_turns_count_against_the_message_cap(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server = await serve(start_server, tiny_model, max_chat_messages=4)
    async with server.client() as client:
        first = await create(client, input=[turn("user", "Hi"), turn("assistant", "Hello"),
                                            turn("user", "Again")])
        assert first.status_code == 200, first.text  # 3 turns, and its answer: 4 stored
        within = await create(client, input=[turn("user", "More")], instructions=None)
        over = await create(client, input=[turn("user", "More")],
                            previous_response_id=first.json()["id"])

    assert within.status_code == 200, within.text
    assert_invalid(over, "input", "previous_response_id", "5 messages", "limit of 4")
    assert len(server.recorder.submitted) == 2  # the refused reached no engine


async def test_a_previous_responses_turns_count_against_the_character_cap(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server = await serve(start_server, tiny_model, max_prompt_chars=300)
    async with server.client() as client:
        first = await create(client, input="a" * 200)
        assert first.status_code == 200, first.text
        over = await create(client, input="b" * 200, previous_response_id=first.json()["id"])

    assert_invalid(over, "input", "previous_response_id", "over the limit of 300")
    assert len(server.recorder.submitted) == 1


async def test_a_limit_of_thousands_of_digits_is_a_400_not_a_500(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server: RunningServer = await serve(start_server, tiny_model)
    async with server.client() as client:
        made = await create(client, input="Hi")
        url = f"/v1/responses/{made.json()['id']}/input_items"
        answers = [await client.get(url, params={"limit": limit})
                   for limit in ("9" * 5000, "0" * 5000 + "1", "101", "0")]
        fine = await client.get(url, params={"limit": "1"})

    for answer in answers:
        assert_invalid(answer, None, "limit must be 1 to 100")
    assert fine.status_code == 200 and len(fine.json()["data"]) == 1


async def test_an_unknown_tool_choice_function_is_named_in_the_message(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server = await serve(start_server, tiny_model)
    tool = {"type": "function", "name": "wx", "parameters": {"type": "object"}}
    async with server.client() as client:
        answer = await create(client, input="Hi", tools=[tool],
                              tool_choice={"type": "function", "name": "nope"})

    assert_invalid(answer, None, "tool_choice names the function 'nope', which is not")
    assert "{name" not in answer.json()["error"]["message"]


async def test_a_past_calls_arguments_of_thousands_of_digits_are_read_as_text(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    """A client's ``function_call`` item carries ``arguments`` as it likes: JSON, or not
    (then the string itself, rendered as text). 5,000 digits are JSON that ``json.loads``
    cannot read: a ValueError that is no JSONDecodeError, so before, the interpreter's
    own message came back ("Exceeds the limit (4300 digits) for integer string
    conversion"); now they are text like any other, here too long for the tiny model's
    context (the prompt's tokens counted as always)."""
    server = await serve(start_server, tiny_model, max_body_bytes=64 * 1024,
                         max_prompt_chars=16_000)
    call = {"type": "function_call", "call_id": "c1", "name": "wx", "arguments": "9" * 5000}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    async with server.client() as client:
        answer = await create(client, input=[turn("user", "Hi"), call, output])

    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "prompt_too_long", error
    assert "digits" not in error["message"]

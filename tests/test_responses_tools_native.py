"""Function tools on ``/v1/responses`` in a model's own format, over real HTTP with the
official openai SDK.

The tiny random models are given chat templates that render ``tools`` as the Hermes /
Qwen 2.5, Llama 3.1 and Mistral families' do (``tests/tool_templates.py``), as in
``test_tools_native.py`` for the chat and Messages routes. The constraint (the family's
grammar) makes the answer a call in that syntax; the server reads it back into the
Responses API's ``function_call`` items, streamed, whole, and in the background (the
stored record's parsing, which a retrieve reads, the same as the foreground answer's).
Each test checks that the call validates, its streamed fragments join into its
arguments, and the prompt the template rendered holds the family's own tool block and
not the generic format's text; a template without tools keeps the generic format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from app.schemas.tools import ANSWER_FORMAT
from engine.model import LoadedModel
from tests.http_server import StartServer
from tests.test_responses_background import settled
from tests.test_tools_native import FAMILIES, WX_PARAMETERS, family_server, sdk
from tests.tool_servers import MODEL, Wx, constrain_once
from tests.tool_templates import CHATML, HERMES_TEMPLATE

QUESTION = "Weather in Paris?"
WX_FUNCTION: Any = {"type": "function", "name": "wx", "parameters": WX_PARAMETERS,
                    "strict": True}
ONE_CALL: dict[str, Any] = {"model": MODEL, "input": QUESTION, "tools": [WX_FUNCTION],
                            "tool_choice": "required", "parallel_tool_calls": False,
                            "max_output_tokens": 80, "temperature": 0}


@pytest.fixture(scope="module", autouse=True)
def constrained_once(tiny_model: Callable[[str], LoadedModel]) -> None:
    constrain_once(tiny_model("tiny-gpt2"))


def calls_of(response: Any) -> list[tuple[str, str, str]]:
    """A response's function calls: (name, call id, arguments) each."""
    return [(item.name, item.call_id, item.arguments) for item in response.output
            if item.type == "function_call"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_required_call_streams_in_the_family_s_format_as_a_function_call(
    family: str, start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    name, template, tool_block = FAMILIES[family]
    server, engine = await family_server(start_server, tiny_model(name), template)
    async with sdk(server) as client:
        events = [e async for e in await client.responses.create(**ONE_CALL, stream=True)]

    final = events[-1].response
    [(called, call_id, arguments)] = calls_of(final)
    assert final.status == "completed" and called == "wx" and call_id.startswith("call_")
    assert Wx.model_validate_json(arguments)
    assert "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta") == arguments
    assert [item.type for item in final.output] == ["function_call"]  # no framing as text
    [prompt] = engine.prompts
    assert tool_block in prompt and ANSWER_FORMAT not in prompt


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_whole_answer_with_a_named_function_is_one_call_of_it(
    family: str, start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    name, template, tool_block = FAMILIES[family]
    server, engine = await family_server(start_server, tiny_model(name), template)
    async with sdk(server) as client:
        answer = await client.responses.create(
            model=MODEL, input=QUESTION, tools=[WX_FUNCTION], max_output_tokens=80,
            tool_choice={"type": "function", "name": "wx"}, extra_body={"seed": 7})

    [(called, _, arguments)] = calls_of(answer)
    assert answer.status == "completed" and answer.output_text == ""
    assert called == "wx" and Wx.model_validate_json(arguments)
    assert tool_block in engine.prompts[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_background_response_s_calls_are_the_foreground_s_when_retrieved(
    family: str, start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    name, template, tool_block = FAMILIES[family]
    server, engine = await family_server(start_server, tiny_model(name), template)
    async with sdk(server) as client:
        made = await client.responses.create(**ONE_CALL, background=True)
        retrieved = await settled(client, made.id)
        foreground = await client.responses.create(**ONE_CALL)

    [(called, call_id, arguments)] = calls_of(retrieved)
    assert made.status == "queued" and retrieved.status == "completed"
    assert called == "wx" and Wx.model_validate_json(arguments)
    assert call_id == f"call_{made.id.removeprefix('resp_')}_0"
    assert [(n, a) for n, _, a in calls_of(foreground)] == [(called, arguments)]
    assert all(tool_block in prompt for prompt in engine.prompts)


async def test_a_round_trip_s_past_call_is_in_the_prompt_in_the_family_s_format(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server, engine = await family_server(start_server, tiny_model("tiny-gpt2"),
                                         HERMES_TEMPLATE)
    async with sdk(server) as client:
        first = await client.responses.create(**ONE_CALL)
        [(_, call_id, arguments)] = calls_of(first)
        await client.responses.create(
            model=MODEL, previous_response_id=first.id, tools=[WX_FUNCTION],
            tool_choice="none", max_output_tokens=2,
            input=[{"type": "function_call_output", "call_id": call_id, "output": "sunny"}])

    past = f'<tool_call>\n{{"name": "wx", "arguments": {arguments}}}\n</tool_call>'
    assert past in engine.prompts[1]
    assert '"tool_calls"' not in engine.prompts[1] and "sunny" in engine.prompts[1]


async def test_a_template_without_tools_keeps_the_generic_format(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server, engine = await family_server(start_server, tiny_model("tiny-gpt2"), CHATML)
    async with sdk(server) as client:
        events = [e async for e in await client.responses.create(**ONE_CALL, stream=True)]
        retrieved = await client.responses.retrieve(events[-1].response.id)

    [(called, _, arguments)] = calls_of(events[-1].response)
    assert called == "wx" and Wx.model_validate_json(arguments)
    assert calls_of(retrieved) == calls_of(events[-1].response)
    assert ANSWER_FORMAT in engine.prompts[0]


async def test_a_request_without_tools_gives_the_template_none(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server, engine = await family_server(start_server, tiny_model("tiny-gpt2"),
                                         HERMES_TEMPLATE)
    async with sdk(server) as client:
        answer = await client.responses.create(model=MODEL, input=QUESTION,
                                               max_output_tokens=4, temperature=0)

    assert [item.type for item in answer.output] == ["message"]
    assert "<tools>" not in engine.prompts[0]

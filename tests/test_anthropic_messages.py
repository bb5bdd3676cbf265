"""``/v1/messages`` on the wire: the event sequence, stop reasons, keep-alive pings, and
Anthropic's error bodies, read as raw HTTP (httpx, no SDK), plus the encoder and the
body's schema without a server.

The server's tiny model has the ChatML template of the OpenAI tests and no
end-of-sequence token unless a test gives it one (as in ``tests/test_anthropic_sdk.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from app.routes.anthropic_errors import anthropic_error_envelope
from app.schemas import MessagesBody, RequestLimits
from app.wire import AnthropicEvents, whole_message
from engine import FinishEvent, FinishReason, TokenEvent
from engine.model import LoadedModel
from streams import ErrorType, ServerSentEvent, StreamError
from tests.http_clients import parse_sse
from tests.http_server import SETTLE_TIMEOUT_S, RunningServer, StartServer
from tests.test_anthropic_sdk import GREEDY, KEY, LONG_MAX_TOKENS, MODEL, QUESTION, tiny_engine
from tests.test_openai_sdk import with_chat_template

LIMITS = RequestLimits(max_prompt_chars=3000, max_new_tokens_limit=500,
                       default_max_new_tokens=8, request_policies=frozenset())


@pytest.fixture
def chat_model(tiny_model: Callable[[str], LoadedModel]) -> LoadedModel:
    return with_chat_template(tiny_model("tiny-gpt2"))


@pytest.fixture
async def chat_server(start_server: StartServer, chat_model: LoadedModel) -> RunningServer:
    """As ``test_anthropic_sdk.chat_server``: ChatML, no end-of-sequence token."""
    return await start_server(make_engine=tiny_engine(chat_model, eos_token_ids=frozenset()),
                              model_name=MODEL)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 6, "messages": QUESTION, **GREEDY, **fields}


async def post(server: RunningServer, path: str = "/v1/messages", **kwargs: Any) -> httpx.Response:
    async with server.client() as client:
        return await client.post(path, **kwargs)


def data_of(events: list[ServerSentEvent]) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in events]


# -- the event sequence ---------------------------------------------------------------


async def test_stream_is_the_documented_event_sequence(
    chat_server: RunningServer,
) -> None:
    whole = (await post(chat_server, json=body())).json()

    response = await post(chat_server, json=body(stream=True))
    events = parse_sse(response.content)
    names = [e.event for e in events]
    data = data_of(events)

    assert response.headers["content-type"].startswith("text/event-stream")
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert [d["type"] for d in data] == names  # each body repeats its type
    assert b"\nid:" not in response.content and not response.content.startswith(b"id:")
    start = data[0]["message"]
    assert start["id"] == "msg_" + response.headers["x-request-id"]
    assert (start["content"], start["stop_reason"], start["model"]) == ([], None, MODEL)
    prompt_tokens = whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"]
    assert start["usage"] == {"input_tokens": prompt_tokens, "output_tokens": 0,
                              "service_tier": "standard"}  # the tier that serves it
    assert data[1] == {"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert all(d["type"] == "text_delta" and d["text"] for d in deltas)  # none empty
    assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"]
    counts = {k: v for k, v in whole["usage"].items() if k != "service_tier"}  # start's
    assert data[-2] == {"type": "message_delta",
                        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                        "usage": counts}
    assert data[-1] == {"type": "message_stop"}


async def test_whole_answer_is_the_message_object(
    chat_server: RunningServer,
) -> None:
    response = await post(chat_server, json=body())
    message = response.json()

    assert response.status_code == 200
    assert message["id"] == "msg_" + response.headers["x-request-id"]
    assert response.headers["request-id"] == response.headers["x-request-id"]
    assert set(message) == {"id", "type", "role", "model", "content", "stop_reason",
                            "stop_sequence", "usage"}
    assert (message["type"], message["role"], message["model"]) == (
        "message", "assistant", MODEL)
    assert [block["type"] for block in message["content"]] == ["text"]
    assert message["usage"]["output_tokens"] == 6


async def test_stop_sequence_names_the_one_that_matched_of_one_or_several(
    chat_server: RunningServer,
) -> None:
    text = (await post(chat_server, json=body(max_tokens=12))).json()["content"][0]["text"]
    assert len(text) >= 5
    stop = text[3:5]

    one = (await post(chat_server, json=body(max_tokens=12, stop_sequences=[stop]))).json()
    streamed = await post(chat_server, json=body(max_tokens=12, stop_sequences=[stop],
                                                 stream=True))
    several = (await post(chat_server, json=body(max_tokens=12, stream=True,
                                                 stop_sequences=["\u2603", stop, "\u2604"])))
    several_whole = (await post(chat_server, json=body(max_tokens=12,
                                                       stop_sequences=["\u2603", stop]))).json()

    assert (one["stop_reason"], one["stop_sequence"]) == ("stop_sequence", stop)
    assert one["content"][0]["text"] == text[:text.index(stop)]
    delta = data_of(parse_sse(streamed.content))[-2]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    assert data_of(parse_sse(several.content))[-2]["delta"] == delta
    assert (several_whole["stop_reason"], several_whole["stop_sequence"]) == (
        "stop_sequence", stop)


async def test_end_of_sequence_is_end_turn_in_both_forms(
    start_server: StartServer, chat_model: LoadedModel
) -> None:
    every_token_ends = frozenset(range(chat_model.model.config.vocab_size))
    server = await start_server(make_engine=tiny_engine(chat_model,
                                                        eos_token_ids=every_token_ends),
                                model_name=MODEL)

    whole = (await post(server, json=body())).json()
    events = data_of(parse_sse((await post(server, json=body(stream=True))).content))

    assert (whole["stop_reason"], whole["usage"]["output_tokens"]) == ("end_turn", 1)
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 1
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(deltas) == whole["content"][0]["text"]


async def test_quiet_stream_sends_ping_events_not_comments(
    start_server: StartServer, chat_model: LoadedModel
) -> None:
    server = await start_server(make_engine=tiny_engine(chat_model), model_name=MODEL,
                                keepalive_s=0.05)
    server.recorder.hold()
    raw = bytearray()

    async with server.client() as client, client.stream(
        "POST", "/v1/messages", json=body(max_tokens=2, stream=True)
    ) as response:
        chunks = response.aiter_raw()
        with trio.fail_after(SETTLE_TIMEOUT_S):
            while raw.count(b"event: ping\n") < 3:  # the opening's, then two keep-alives
                raw += await anext(chunks)
        server.recorder.release()
        async for chunk in chunks:
            raw += chunk

    names = [e.event for e in parse_sse(bytes(raw))]
    assert not [line for line in bytes(raw).split(b"\n") if line.startswith(b":")]
    assert names[:4] == ["message_start", "content_block_start", "ping", "ping"]
    assert names[-1] == "message_stop"


async def test_failure_after_the_first_byte_is_an_error_event_last(
    chat_server: RunningServer,
) -> None:
    async with chat_server.client() as client, client.stream(
        "POST", "/v1/messages", json=body(max_tokens=LONG_MAX_TOKENS, stream=True)
    ) as response:
        raw = b""
        chunks = response.aiter_raw()
        while b"content_block_delta" not in raw:
            raw += await anext(chunks)
        chat_server.recorder.fail(response.headers["x-request-id"])
        async for chunk in chunks:
            raw += chunk

    last = parse_sse(raw)[-1]
    assert last.event == "error"
    error = json.loads(last.data)
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == "api_error"
    assert error["error"]["message"].startswith("engine_error: ")


# -- refusals in Anthropic's body -----------------------------------------------------


@pytest.mark.parametrize(("fields", "status", "kind", "named"), [
    ({"messages": [{"role": "user", "content": [{"type": "thinking",
                                                 "thinking": "x", "signature": "s"}]}]},
     400, "invalid_request_error", "messages.0.content"),
    ({"system": [{"type": "image", "source": {}}]}, 400, "invalid_request_error", "system"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({"top_k": 0}, 400, "invalid_request_error", "top_k"),
    ({"max_tokens": "6"}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-opus-4-1"}, 404, "not_found_error", "claude-opus-4-1"),
])
async def test_refusals_are_anthropic_errors(
    chat_server: RunningServer, fields: dict[str, Any], status: int, kind: str, named: str
) -> None:
    response = await post(chat_server, json=body(**fields))

    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == kind
    assert named in error["error"]["message"]
    assert response.headers["x-should-retry"] == "false"
    assert chat_server.recorder.submitted == []


async def test_body_that_is_not_json_is_refused_in_anthropic_s_shape(
    chat_server: RunningServer,
) -> None:
    not_json = await post(chat_server, content=json.dumps(body()),
                          headers={"Content-Type": "text/plain"})
    broken = await post(chat_server, content=b"{", headers={"Content-Type": "application/json"})

    assert not_json.status_code == 415
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    assert broken.status_code == 400
    assert broken.json()["error"]["message"].startswith("invalid_json: ")


async def test_missing_or_wrong_key_is_authentication_error_either_header_works(
    start_server: StartServer, chat_model: LoadedModel
) -> None:
    server = await start_server(make_engine=tiny_engine(chat_model), model_name=MODEL,
                                api_key=KEY)

    missing = await post(server, json=body())
    wrong = await post(server, json=body(), headers={"x-api-key": KEY[:-1] + "x"})
    by_header = await post(server, "/v1/messages/count_tokens", json={
        "model": MODEL, "messages": QUESTION}, headers={"x-api-key": KEY})
    by_bearer = await post(server, "/v1/messages/count_tokens", json={
        "model": MODEL, "messages": QUESTION}, headers={"Authorization": f"Bearer {KEY}"})

    for refused in (missing, wrong):
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
    assert by_header.status_code == by_bearer.status_code == 200
    assert by_header.json() == by_bearer.json()


async def test_count_tokens_counts_the_rendered_conversation(
    chat_server: RunningServer,
) -> None:
    rendered = ("<|im_start|>system\nBe brief.\nVery.<|im_end|>\n<|im_start|>user\n"
                "The capital\nof France is<|im_end|>\n<|im_start|>assistant\n")

    response = await post(chat_server, "/v1/messages/count_tokens", json={
        "model": MODEL, "system": [{"type": "text", "text": "Be brief."},
                                   {"type": "text", "text": "Very."}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "The capital"},
            {"type": "text", "text": "of France is", "cache_control": {"type": "ephemeral"}}]}]})

    assert response.status_code == 200
    assert response.json() == {"input_tokens": len(chat_server.recorder.tokenize(rendered))}
    assert chat_server.recorder.submitted == []


# -- without a server: the body and the encoder ---------------------------------------


def test_sampling_defaults_to_the_api_s_and_takes_extra_body_fields() -> None:
    plain = MessagesBody.model_validate_json(json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": QUESTION}), context=LIMITS)
    tuned = MessagesBody.model_validate_json(json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "temperature": 0.5,
         "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"}, "tools": [],
         "thinking": {"type": "disabled"}}), context=LIMITS)

    default = plain.generation_request("p", (1, 2)).sampling
    chosen = tuned.generation_request("p", (1, 2)).sampling
    assert (default.temperature, default.top_p, default.top_k) == (1.0, 1.0, 0)
    assert (chosen.temperature, chosen.top_p, chosen.top_k) == (0.5, 0.9, 5)


def test_encoder_sends_no_empty_delta_and_ends_with_the_finish() -> None:
    events = AnthropicEvents("abc", MODEL, 7, error_envelope=anthropic_error_envelope)
    finish = FinishEvent("abc", FinishReason.STOP, 7, 3, stop_sequence="\n", cached_tokens=4)

    held = events.encode([TokenEvent("abc", 0, 11, "")])
    tail = data_of(parse_sse(events.encode([TokenEvent("abc", 1, 12, "Hi"), finish])))

    assert held == b""
    assert [e["type"] for e in tail] == ["content_block_delta", "content_block_stop",
                                         "message_delta", "message_stop"]
    assert tail[2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n"}
    # as the API counts them: the 4 found cached are read, not input (4 + 3 = the 7)
    assert tail[2]["usage"] == {"input_tokens": 3, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 4, "output_tokens": 3}
    assert whole_message("abc", MODEL, "Hi", finish)["usage"] == tail[2]["usage"]
    assert whole_message("abc", MODEL, "Hi", finish)["stop_sequence"] == "\n"


def test_encoder_error_event_has_anthropic_s_shape() -> None:
    events = AnthropicEvents("abc", MODEL, 7, error_envelope=anthropic_error_envelope)

    (shutdown,) = parse_sse(events.encode([StreamError(ErrorType.SHUTDOWN, "stopping")]))
    (unknown,) = parse_sse(events.error("no_such_type", "oops"))

    assert shutdown.event == "error"
    assert json.loads(shutdown.data) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "shutdown: stopping"}}
    assert json.loads(unknown.data)["error"]["type"] == "api_error"
    assert parse_sse(events.keepalive())[0].event == "ping"

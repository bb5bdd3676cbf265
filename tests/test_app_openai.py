"""``/v1/completions``, the OpenAI-compatible protocol, over real HTTP on the tiny model.

It shares the hub and streams with ``/v1/stream``, so it must give the same tokens, and
the fixture's checks (no stream open, cache whole, releases == admitted) hold after it.
"""

from __future__ import annotations

import json

from tests.http_clients import parse_sse, stream_body
from tests.http_server import RunningServer


def completions_body(**fields: object) -> dict[str, object]:
    return {"model": "tiny-gpt2", "prompt": stream_body()["prompt"], "temperature": 0, **fields}


async def test_whole_completion_matches_generate(server: RunningServer) -> None:
    async with server.client() as client:
        ours = (await client.post("/v1/generate", json=stream_body(max_new_tokens=7))).json()
        response = await client.post("/v1/completions", json=completions_body(max_tokens=7))

    answer = response.json()
    assert response.status_code == 200
    assert answer["object"] == "text_completion"
    assert answer["model"] == "tiny-gpt2"
    assert answer["choices"] == [
        {"index": 0, "text": ours["text"], "logprobs": None, "finish_reason": "length"}
    ]
    prompt, made, cached = (ours["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                                       "cached_tokens"))
    assert answer["usage"] == {"prompt_tokens": prompt, "completion_tokens": made,
                               "total_tokens": prompt + made,
                               "prompt_tokens_details": {"cached_tokens": cached}}


async def test_streamed_chunks_end_with_finish_reason_then_done(server: RunningServer) -> None:
    async with server.client() as client:
        ours = (await client.post("/v1/generate", json=stream_body(max_new_tokens=5))).json()
        async with client.stream(
            "POST", "/v1/completions", json=completions_body(max_tokens=5, stream=True)
        ) as response:
            raw = b"".join([chunk async for chunk in response.aiter_raw()])

    events = parse_sse(raw)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1].data == "[DONE]"
    chunks = [json.loads(e.data) for e in events[:-1]]
    assert len(chunks) == 6  # one per token, then the finish
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ours["text"]
    assert {c["id"] for c in chunks} == {f"cmpl-{response.headers['x-request-id']}"}


async def test_stop_string_reports_stop(server: RunningServer) -> None:
    async with server.client() as client:
        text = (await client.post("/v1/generate", json=stream_body(max_new_tokens=8))).json()[
            "text"
        ]
        stop = text[3:5]
        response = await client.post(
            "/v1/completions", json=completions_body(max_tokens=8, stop=stop)
        )

    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.index(stop)]


async def test_unsupported_fields_are_refused_with_openais_400(server: RunningServer) -> None:
    cases = [({"n": 9}, "n"), ({"echo": True}, "echo"), ({"max_tokens": 0}, "max_tokens"),
             ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"min_tokens": 3}, "min_tokens"),
             ({"prompt": None}, "prompt")]
    async with server.client() as client:
        for fields, param in cases:
            response = await client.post("/v1/completions", json=completions_body(**fields))

            assert response.status_code == 400, fields
            assert response.headers["x-should-retry"] == "false"
            error = response.json()["error"]
            assert error["param"] == param
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
            assert set(error) == {"message", "type", "param", "code"}


async def test_neutral_values_of_unsupported_fields_are_accepted(server: RunningServer) -> None:
    neutral = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
               "echo": False, "best_of": 1, "min_tokens": 0, "logprobs": None}
    async with server.client() as client:
        response = await client.post("/v1/completions", json=completions_body(max_tokens=2,
                                                                                **neutral))

    assert response.status_code == 200, response.text


async def test_unknown_fields_are_ignored_like_openai_clients_expect(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        response = await client.post(
            "/v1/completions", json=completions_body(max_tokens=2, user="someone", logit_bias={})
        )

    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 2

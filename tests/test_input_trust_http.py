"""Every body must be JSON and say so (issue 23, item 5), over real HTTP.

A browser sends a "simple" cross-origin request (``text/plain``, a form) without asking
the server first, so a page on any site could make a browser on this machine post to a
server that has no API key. Every POST route with a JSON body answers anything but
``application/json`` (parameters such as ``charset`` allowed) with 415
``unsupported_media_type`` in its envelope, and opens nothing.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.http_clients import stream_body
from tests.http_server import RunningServer

NOT_JSON = [
    None,  # no Content-Type at all (curl -d sends a form's; httpx content= sends none)
    "text/plain;charset=UTF-8",  # what a browser's fetch() of a string sends
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "text/json",
    "application/jsonx",
    "application/json, text/plain",
]
NATIVE = ["/v1/stream", "/v1/generate", "/v1/requests"]
OPENAI = {
    "/v1/completions": {"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 1},
    "/v1/chat/completions": {"model": "tiny-gpt2", "max_tokens": 1,
                             "messages": [{"role": "user", "content": "Hello"}]},
}


async def post_as(server: RunningServer, path: str, body: dict[str, Any],
                  content_type: str | None) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    async with server.client() as client:
        return await client.post(path, content=httpx.Request("POST", "/", json=body).content,
                                 headers=headers)


def assert_nothing_opened(server: RunningServer) -> None:
    assert server.hub.statistics().opened == 0
    assert server.recorder.submitted == []


@pytest.mark.parametrize("path", NATIVE)
async def test_a_native_route_answers_a_body_not_sent_as_json_with_415(
    server: RunningServer, path: str,
) -> None:
    for content_type in NOT_JSON:
        response = await post_as(server, path, stream_body(max_new_tokens=1), content_type)

        assert response.status_code == 415, (content_type, response.text)
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert sorted(error) == ["message", "type"]
        assert error["type"] == "unsupported_media_type"
        assert "application/json" in error["message"]
    assert_nothing_opened(server)


@pytest.mark.parametrize("path", sorted(OPENAI))
async def test_an_openai_route_answers_a_body_not_sent_as_json_with_415_in_its_shape(
    server: RunningServer, path: str,
) -> None:
    for content_type in NOT_JSON:
        response = await post_as(server, path, OPENAI[path], content_type)

        assert response.status_code == 415, (content_type, response.text)
        error = response.json()["error"]
        assert sorted(error) == ["code", "message", "param", "type"]
        assert (error["code"], error["type"]) == ("unsupported_media_type",
                                                  "invalid_request_error")
        assert response.headers["x-should-retry"] == "false"
    assert_nothing_opened(server)


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
async def test_json_with_or_without_parameters_is_served(
    server: RunningServer, content_type: str,
) -> None:
    response = await post_as(server, "/v1/generate", stream_body(max_new_tokens=1),
                             content_type)

    assert response.status_code == 200, response.text
    assert response.json()["finish_reason"] == "length"


async def test_the_key_is_checked_before_the_content_type(start_server: Any) -> None:
    server = await start_server(api_key="k" * 32)

    response = await post_as(server, "/v1/generate", stream_body(), "text/plain")

    assert response.status_code == 401
    assert response.json()["error"]["type"] == "unauthorized"

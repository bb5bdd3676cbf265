"""``STREAMSCOPE_API_KEY`` over real HTTP: 401 with the envelope, except where open."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.auth import bearer_token
from app.settings import Settings, SettingsError
from tests.http_clients import parse_sse, stream_body
from tests.http_server import RunningServer, StartServer

KEY = "sk-test-0123456789"
GENERATE = stream_body(max_new_tokens=2, ignore_eos=True)
# (method, path, JSON body) of every protected route; /v1/requests/<id> is added per test.
PROTECTED: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/stream", GENERATE),
    ("POST", "/v1/generate", GENERATE),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("GET", "/stats", None),
]
OPEN = ["/health", "/ready", "/metrics"]


@pytest.fixture
async def keyed(start_server: StartServer) -> RunningServer:
    return await start_server(api_key=KEY)


async def call(server: RunningServer, method: str, path: str, body: dict[str, Any] | None,
               headers: dict[str, str]) -> httpx.Response:
    async with server.client() as client:
        return await client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY},
], ids=["none", "wrong", "longer", "basic", "no-scheme"])
async def test_every_protected_route_refuses_without_the_key(
    keyed: RunningServer, headers: dict[str, str]
) -> None:
    for method, path, body in [*PROTECTED, ("GET", "/v1/requests/abc", None),
                               ("GET", "/no/such/route", None)]:
        response = await call(keyed, method, path, body, headers)

        assert response.status_code == 401, path
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]  # OpenAI routes: OpenAI's shape, our type as code
        assert "unauthorized" in (error["type"], error.get("code")), path
    assert keyed.recorder.submitted == []  # refused before anything reached the engine


async def test_every_protected_route_answers_with_the_key(keyed: RunningServer) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in PROTECTED:
        response = await call(keyed, method, path, body, headers)
        assert response.status_code == 200, (path, response.text)
    stream = await call(keyed, "POST", "/v1/stream", GENERATE, headers)
    assert parse_sse(stream.content)[-1].event == "done"

    finished = await call(keyed, "GET", f"/v1/requests/{stream.headers['x-request-id']}",
                          None, headers)
    assert finished.status_code == 200


async def test_scheme_is_case_insensitive_like_rfc_7235(keyed: RunningServer) -> None:
    response = await call(keyed, "GET", "/stats", None, {"Authorization": f"bearer {KEY}"})

    assert response.status_code == 200


@pytest.mark.parametrize("path", OPEN)
async def test_probes_and_metrics_need_no_key(keyed: RunningServer, path: str) -> None:
    response = await call(keyed, "GET", path, None, {})

    assert response.status_code == 200


async def test_no_key_set_means_no_auth(server: RunningServer) -> None:
    response = await call(server, "GET", "/stats", None, {})

    assert response.status_code == 200


async def test_refused_key_is_counted_as_401(keyed: RunningServer) -> None:
    await call(keyed, "GET", "/stats", None, {})

    async with keyed.client() as client:
        scrape = (await client.get("/metrics")).text
    assert 'streamscope_refusals_total{status="401",type="unauthorized"} 1.0' in scrape


def test_api_key_must_be_visible_ascii_and_is_never_echoed() -> None:
    with pytest.raises(SettingsError, match="STREAMSCOPE_API_KEY") as caught:
        Settings.from_env({"STREAMSCOPE_API_KEY": "secret with spaces"})

    assert "secret" not in str(caught.value)
    assert "secret" not in repr(Settings(api_key="secret"))
    assert Settings.from_env({"STREAMSCOPE_API_KEY": KEY}).api_key == KEY


@pytest.mark.parametrize(("header", "token"), [
    (f"Bearer {KEY}", KEY),
    (f"  BEARER   {KEY} ", KEY),
    ("Bearer", None),
    ("Bearer ", None),
    (f"Token {KEY}", None),
    ("", None),
])
def test_bearer_token_is_read_from_the_header(header: str, token: str | None) -> None:
    assert bearer_token(header) == token

"""``STREAMSCOPE_API_KEY`` over real HTTP: 401 with the envelope, except where open; the
stream read token (a derived key, an expiry); keys of at least 32 characters."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import httpx
import pytest

from app.auth import bearer_token
from app.settings import Settings, SettingsError
from tests.http_clients import parse_sse, stream_body
from tests.http_server import RunningServer, StartServer

KEY = "sk-test-0123456789abcdefghijklmnopqrstuv"  # 40 characters: at least 32
TTL_S = 600.0
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
    return await start_server(api_key=KEY, stream_token_ttl_s=TTL_S)


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


def read_token(request_id: str, expiry: int) -> str:
    """The read token as app/api_keys.py documents it, made here from the key alone."""
    token_key = hmac.new(KEY.encode(), b"streamscope stream token", hashlib.sha256).digest()
    mac = hmac.new(token_key, f"{request_id}.{expiry}".encode(), hashlib.sha256).hexdigest()
    return f"{expiry}.{mac}"


def expiry_of(stream_url: str) -> int:
    return int(stream_url.partition("?token=")[2].partition(".")[0])


async def test_a_created_stream_url_carries_a_token_that_opens_only_that_stream(
    keyed: RunningServer,
) -> None:
    """EventSource cannot send headers: the page reads a stream with the URL that
    ``POST /v1/requests`` answered, whose token opens GET /v1/stream/<that id> only."""
    bearer = {"Authorization": f"Bearer {KEY}"}
    first = (await call(keyed, "POST", "/v1/requests", GENERATE, bearer)).json()
    other = (await call(keyed, "POST", "/v1/requests", GENERATE, bearer)).json()
    token = read_token(first["id"], expiry_of(first["stream_url"]))
    wrong_digit = "1" if token.endswith("0") else "0"  # never the token itself

    assert first["stream_url"] == f"/v1/stream/{first['id']}?token={token}"
    read = await call(keyed, "GET", first["stream_url"], None, {})
    assert read.status_code == 200
    assert parse_sse(read.content)[-1].event == "done"
    for method, path in [
        ("GET", f"/v1/stream/{other['id']}?token={token}"),  # another stream
        ("GET", f"/v1/stream/{first['id']}?token={token[:-1]}{wrong_digit}"),  # wrong
        ("GET", f"/v1/stream/{first['id']}?token="),
        ("DELETE", f"/v1/requests/{first['id']}?token={token}"),
        ("GET", f"/v1/requests/{first['id']}?token={token}"),
        ("POST", f"/v1/stream?token={token}"),
    ]:
        response = await call(keyed, method, path, GENERATE if method == "POST" else None, {})
        assert response.status_code == 401, (method, path)
    assert (await call(keyed, "GET", other["stream_url"], None, {})).status_code == 200
    # The page's reopen adds its position to the URL: the token still opens it.
    resumed = await call(keyed, "GET", f"{first['stream_url']}&last_event_id={first['id']}:3",
                         None, {})
    assert parse_sse(resumed.content)[0].id == f"{first['id']}:4"


async def test_the_api_key_cookie_opens_nothing(keyed: RunningServer) -> None:
    """The master key never travels in a cookie (browsers send cookies to every port
    of the host): the old ``streamscope_key`` cookie is not accepted anywhere."""
    bearer = {"Authorization": f"Bearer {KEY}"}
    request_id = (await call(keyed, "POST", "/v1/requests", GENERATE, bearer)).json()["id"]

    response = await call(keyed, "GET", f"/v1/stream/{request_id}", None,
                          {"Cookie": f"streamscope_key={KEY}"})

    assert response.status_code == 401


async def test_without_a_key_the_stream_url_has_no_token(server: RunningServer) -> None:
    created = (await call(server, "POST", "/v1/requests", GENERATE, {})).json()

    assert created["stream_url"] == f"/v1/stream/{created['id']}"


async def test_the_read_token_is_signed_with_a_derived_key_and_expires(
    keyed: RunningServer,
) -> None:
    """The token is ``<expiry>.<mac>`` under a key derived from the API key, not
    ``HMAC(key, id)``: a token of the old form, an expired one (signed right), or one
    whose expiry was moved on opens nothing; the stream_url's opens the stream."""
    bearer = {"Authorization": f"Bearer {KEY}"}
    before = time.time()
    created = (await call(keyed, "POST", "/v1/requests", GENERATE, bearer)).json()
    request_id, expiry = created["id"], expiry_of(created["stream_url"])
    old_form = hmac.new(KEY.encode(), request_id.encode(), hashlib.sha256).hexdigest()
    expired = read_token(request_id, int(before) - 1)
    moved_on = f"{expiry + 3600}.{read_token(request_id, expiry).partition('.')[2]}"

    assert before + TTL_S <= expiry <= time.time() + TTL_S + 1
    for token in (old_form, expired, moved_on, f"{expiry}.{old_form}"):
        response = await call(keyed, "GET", f"/v1/stream/{request_id}?token={token}", None, {})
        assert response.status_code == 401, token
    read = await call(keyed, "GET", created["stream_url"], None, {})
    assert read.status_code == 200
    assert parse_sse(read.content)[-1].event == "done"


def test_api_key_must_be_visible_ascii_and_is_never_echoed() -> None:
    with pytest.raises(SettingsError, match="STREAMSCOPE_API_KEY") as caught:
        Settings.from_env({"STREAMSCOPE_API_KEY": "secret with spaces and long enough"})

    assert "secret" not in str(caught.value)
    assert KEY not in repr(Settings(api_key=KEY))
    assert Settings.from_env({"STREAMSCOPE_API_KEY": KEY}).api_key == KEY


@pytest.mark.parametrize("env", [
    {"STREAMSCOPE_API_KEY": "k" * 31},
    {"STREAMSCOPE_API_KEYS": '[{"name": "ci", "key": "%s"}]' % ("k" * 31)},
], ids=["api_key", "api_keys"])
def test_an_api_key_shorter_than_32_characters_stops_the_server_at_startup(
    env: dict[str, str],
) -> None:
    with pytest.raises(SettingsError, match="at least 32 characters") as caught:
        Settings.from_env(env)

    assert "k" * 31 not in str(caught.value)
    assert Settings.from_env({"STREAMSCOPE_API_KEY": "k" * 32}).api_key == "k" * 32


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

"""A keyless server refuses a request that names no host, and serves no ``/static/``
(issue 43, item 6), over real HTTP (hypercorn on loopback, raw sockets where the
request must be one no HTTP client library would send).

Before: an empty ``Host:`` (and HTTP/1.0's missing one) passed the keyless server's
DNS-rebinding check (``app/hosts.py``), and Quart's default ``/static/<path>`` route
served ``app/static`` (the pages' files, already served by their own routes), live and
undocumented.
"""

from __future__ import annotations

import pytest

from tests.http_server import RunningServer, StartServer
from tests.test_http_connection import exchange_raw


@pytest.mark.parametrize("head", [
    b"GET /v1/models HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n",
    b"GET /stats HTTP/1.1\r\nHost:\r\nConnection: close\r\n\r\n",
    b"GET /v1/models HTTP/1.0\r\n\r\n",
], ids=["empty", "empty-no-space", "http-1.0-none"])
async def test_a_keyless_server_refuses_a_request_that_names_no_host(
    server: RunningServer, head: bytes,
) -> None:
    reply = await exchange_raw(server.host, server.port, head)

    assert reply.status == 400, reply
    error = reply.json()["error"]
    assert error["type"] in ("bad_request", "invalid_request_error"), error
    assert "names none" in error["message"]


async def test_a_named_local_host_and_the_probes_are_still_answered(
    server: RunningServer,
) -> None:
    named = await exchange_raw(server.host, server.port,
                               b"GET /v1/models HTTP/1.0\r\nHost: localhost\r\n\r\n")
    probe = await exchange_raw(server.host, server.port, b"GET /health HTTP/1.0\r\n\r\n")

    assert named.status == 200 and probe.status == 200


async def test_any_host_when_the_operator_allows_any(start_server: StartServer) -> None:
    server = await start_server(allowed_hosts=frozenset({"*"}))
    reply = await exchange_raw(server.host, server.port,
                               b"GET /v1/models HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n")
    assert reply.status == 200, reply


@pytest.mark.parametrize("path", ["/static/page.js", "/static/index.html",
                                  "/static/scope.js"])
async def test_there_is_no_static_route(server: RunningServer, path: str) -> None:
    async with server.client() as client:
        answer = await client.get(path)
        page = await client.get("/page.js")  # the pages' files have their own routes

    assert answer.status_code == 404, answer.text[:80]
    assert answer.json()["error"]["type"] == "not_found"
    assert page.status_code == 200

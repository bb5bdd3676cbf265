"""``hypercorn app:app`` without ``-k trio`` refuses loudly instead of serving nothing.

Under hypercorn's asyncio worker the lifespan startup fails with one line naming the
command that works, and the server does not stay up; an HTTP request that reaches the app
under asyncio anyway gets a 500 JSON envelope saying the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import trio

from app.edge.worker_guard import MESSAGE, TRIO_COMMAND
from app.factory import create_app
from tests.http_server import TEST_SETTINGS


async def test_plain_hypercorn_fails_at_startup_naming_the_trio_command() -> None:
    env = {**os.environ, "STREAMSCOPE_MODEL": "tiny-gpt2", "STREAMSCOPE_DEVICE": "cpu"}
    command = [sys.executable, "-m", "hypercorn", "-b", "127.0.0.1:0", "app:app"]

    with trio.fail_after(60):  # the worker imports torch before the lifespan starts
        result = await trio.run_process(command, env=env, capture_stdout=True,
                                        capture_stderr=True, check=False)

    output = (result.stdout + result.stderr).decode()
    assert output.splitlines()[0] == MESSAGE
    assert TRIO_COMMAND in MESSAGE
    # hypercorn 0.18's main process reports 0 even when its worker failed: its
    # run() overwrites the failed worker's exit code (hypercorn/run.py, _join_exited).
    assert "Running on" not in output


def test_a_request_under_asyncio_gets_a_500_envelope_naming_the_command() -> None:
    app = create_app(TEST_SETTINGS)
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": "/health", "raw_path": b"/health",
             "query_string": b"", "root_path": "", "headers": [], "client": None,
             "server": None, "extensions": {}}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]

    start, body = sent
    assert start["status"] == 500
    assert (b"content-type", b"application/json") in start["headers"]
    assert json.loads(body["body"]) == {"error": {"type": "internal_error", "message": MESSAGE}}

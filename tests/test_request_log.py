"""The JSON request log over real HTTP: one line per request, its fields, never its text.

The lines are read as written: the ``streamscope.requests`` logger's records through the
module's own ``JsonFormatter`` into a buffer, then parsed back.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from app.request_log import LOGGER, JsonFormatter, install_json_logging
from tests.http_clients import count_tokens, parse_sse
from tests.http_server import StartServer

SECRET_WORDS = "zebra quartz nebula"  # the prompt: must appear in no log line
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
KEY = "k" * 40


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """What the request logger writes, as JSON lines."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def lines_of(buffer: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


async def test_each_request_ends_with_one_json_line_of_its_fields_and_no_text(
    start_server: StartServer, log_lines: io.StringIO,
) -> None:
    server = await start_server(log_format="json", replica="replica-3",
                                api_keys=[{"name": "ci", "key": KEY}])
    auth = {"Authorization": f"Bearer {KEY}"}
    async with server.client(headers=auth) as client:
        streamed = await client.post(
            "/v1/stream", json={"prompt": SECRET_WORDS, "max_new_tokens": 6, "ignore_eos": True},
            headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
        refused = await client.post("/v1/generate",
                                    json={"prompt": SECRET_WORDS, "max_new_tokens": 100_000})
    assert streamed.status_code == 200 and refused.status_code == 422
    assert count_tokens(parse_sse(streamed.content)) == 6
    finish = await server.wait_finished(streamed.headers["X-Request-ID"])

    assert SECRET_WORDS.split()[0] not in log_lines.getvalue()
    stream_line, refused_line = lines_of(log_lines)
    assert stream_line.pop("time").endswith("Z")
    ttft, duration = stream_line.pop("ttft_s"), stream_line.pop("duration_s")
    assert 0 < ttft <= duration
    assert stream_line == {
        "level": "INFO", "logger": LOGGER, "message": "request",
        "request_id": streamed.headers["X-Request-ID"], "key": "ci", "route": "/v1/stream",
        "status": 200, "prompt_tokens": finish.prompt_tokens, "output_tokens": 6,
        "finish": "length", "replica": "replica-3",
        "trace_id": TRACE_ID, "span_id": None,  # no tracing: the caller's trace, no span
    }
    assert refused_line["status"] == 422 and refused_line["finish"] == "invalid_request"
    assert refused_line["route"] == "/v1/generate" and refused_line["key"] == "ci"
    assert refused_line["request_id"] is None and refused_line["prompt_tokens"] is None
    assert refused_line["ttft_s"] is None and refused_line["trace_id"] is None


async def test_a_whole_answer_is_logged_with_the_status_it_was_sent_with(
    start_server: StartServer, log_lines: io.StringIO,
) -> None:
    server = await start_server(log_format="json")
    async with server.client() as client:
        answer = await client.post("/v1/generate", json={"prompt": "Hi", "max_new_tokens": 3,
                                                         "ignore_eos": True})
    assert answer.status_code == 200

    (line,) = lines_of(log_lines)
    assert (line["route"], line["status"], line["finish"]) == ("/v1/generate", 200, "length")
    assert line["output_tokens"] == 3 and line["key"] is None
    assert line["request_id"] == answer.headers["X-Request-ID"] == answer.json()["id"]


async def test_the_text_format_writes_no_request_lines(
    start_server: StartServer, log_lines: io.StringIO,
) -> None:
    server = await start_server()  # log_format text, no endpoint: no recorder at all
    assert server.app.metrics.recorder is None
    async with server.client() as client:
        answer = await client.post("/v1/generate", json={"prompt": "Hi", "max_new_tokens": 2})
    assert answer.status_code == 200
    assert log_lines.getvalue() == ""


def test_the_json_formatter_writes_any_log_line_as_one_object() -> None:
    record = logging.LogRecord("streamscope.app", logging.WARNING, __file__, 1,
                               "drained in %.2f s", (1.5,), None)
    line = json.loads(JsonFormatter().format(record))
    assert (line["level"], line["logger"], line["message"]) == \
        ("WARNING", "streamscope.app", "drained in 1.50 s")


def test_json_logging_turns_the_servers_own_handler_to_json() -> None:
    """``streamscope serve`` has put a text handler on the ``streamscope`` logger; with
    ``STREAMSCOPE_LOG_FORMAT=json`` its lines become JSON, with no second handler."""
    logger = logging.getLogger("streamscope")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    buffer = io.StringIO()
    text = logging.StreamHandler(buffer)
    text.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    logger.handlers = [text]
    try:
        install_json_logging()
        install_json_logging()  # idempotent
        logging.getLogger("streamscope.app").info("ready: model %s", "tiny-gpt2")
    finally:
        logger.handlers, logger.level, logger.propagate = saved[0], saved[1], saved[2]
    (line,) = buffer.getvalue().splitlines()
    assert json.loads(line)["message"] == "ready: model tiny-gpt2"


async def test_a_whole_answer_whose_stream_failed_is_logged_with_the_error_it_was_sent(
    start_server: StartServer, log_lines: io.StringIO,
) -> None:
    server = await start_server(log_format="json")
    answers: list[httpx.Response] = []
    async with server.client() as client, trio.open_nursery() as nursery:

        async def ask() -> None:
            answers.append(await client.post("/v1/generate", json={
                "prompt": "Hi", "max_new_tokens": 480, "ignore_eos": True}))

        nursery.start_soon(ask)
        await server.wait_for(lambda: len(server.recorder.admitted()) == 1, "the admission")
        (request_id,) = server.recorder.admitted()
        server.recorder.fail(request_id)  # as a failed forward pass, at its next step

    (answer,) = answers
    assert answer.status_code >= 500
    (line,) = lines_of(log_lines)
    assert line["status"] == answer.status_code
    assert line["finish"] == answer.json()["error"]["type"]

"""Traces over real OTLP: the app's spans as a collector receives and decodes them.

The server (real hypercorn on loopback, the tiny model) exports to ``OtlpReceiver``, a
real HTTP server that decodes each POST with ``opentelemetry-proto``. The spans are
flushed by the app's own provider (``force_flush``, in a worker thread) before they are
read: no waiting on the batch processor's timer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from app.tracing import TraceParent, traces_url
from tests.http_clients import long_body
from tests.http_server import RunningServer, StartServer
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
CALLER = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHILDREN = ("streamscope.prepare", "streamscope.queue_and_prefill", "streamscope.decode")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    """Asked for before ``start_server``, so that it outlives the servers' last flush."""
    with OtlpReceiver().running() as running:
        yield running


async def exported(server: RunningServer, receiver: OtlpReceiver) -> list[ReceivedSpan]:
    """Every span the server made so far, as the receiver decoded them."""
    recorder = server.app.metrics.recorder
    assert recorder is not None and recorder.tracing is not None
    assert await trio.to_thread.run_sync(recorder.tracing.provider.force_flush)
    return receiver.spans()


def server_spans(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in spans if s.span.kind == Span.SPAN_KIND_SERVER]


async def test_a_request_is_one_server_span_in_the_callers_trace_with_genai_attributes(
    receiver: OtlpReceiver, start_server: StartServer,
) -> None:
    server = await start_server(otlp_endpoint=receiver.url, replica="replica-7")
    async with server.client() as client:
        response = await client.post(
            "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 5,
                                     "stream": True, "ignore_eos": True},
            headers={"traceparent": CALLER, "tracestate": "vendor=abc"})
    assert response.status_code == 200
    finish = server.recorder.finish_of(response.headers["X-Request-ID"])
    assert finish is not None

    spans = await exported(server, receiver)
    (root,) = server_spans(spans)
    assert root.name == "text_completion tiny-gpt2"
    assert (root.trace_id, root.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert root.span.trace_state == "vendor=abc"
    assert response.headers["traceresponse"] == f"00-{TRACE_ID}-{root.span_id}-01"
    assert root.attributes == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "streamscope",
        "gen_ai.request.model": "tiny-gpt2",
        "gen_ai.response.model": "tiny-gpt2",
        "gen_ai.request.max_tokens": 5,
        "gen_ai.usage.input_tokens": finish.prompt_tokens,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.response.id": response.headers["X-Request-ID"],
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
    }
    assert root.resource["service.name"] == "streamscope"
    assert root.resource["service.instance.id"] == "replica-7"
    assert b"France" not in b"".join(s.span.SerializeToString() for s in spans)

    children = {s.name: s.span for s in spans if s.parent_span_id == root.span_id}
    assert sorted(children) == sorted(CHILDREN)
    assert all(s.trace_id == TRACE_ID for s in spans)
    prepare, waiting, decode = (children[name] for name in CHILDREN)
    first = root.event("gen_ai.first_token")
    # The children tile the request: arrival -> submitted -> first token -> the ending.
    assert root.span.start_time_unix_nano == prepare.start_time_unix_nano
    assert prepare.end_time_unix_nano == waiting.start_time_unix_nano
    assert waiting.end_time_unix_nano == first.time_unix_nano == decode.start_time_unix_nano
    assert decode.end_time_unix_nano == root.span.end_time_unix_nano
    assert prepare.start_time_unix_nano < waiting.start_time_unix_nano \
        < decode.start_time_unix_nano < decode.end_time_unix_nano


async def test_a_refusal_is_a_span_with_its_status_and_error(
    receiver: OtlpReceiver, start_server: StartServer,
) -> None:
    server = await start_server(otlp_endpoint=receiver.url, max_chat_messages=1)
    body = {"model": "tiny-gpt2", "messages": [{"role": "user", "content": "a"}] * 2}
    async with server.client() as client:
        response = await client.post("/v1/chat/completions", json=body,
                                     headers={"traceparent": CALLER})
    assert response.status_code == 400

    (root,) = server_spans(await exported(server, receiver))
    assert root.name == "chat tiny-gpt2" and root.trace_id == TRACE_ID
    assert root.attributes["http.response.status_code"] == 400
    assert root.attributes["gen_ai.response.finish_reasons"] == ["invalid_request"]
    assert "gen_ai.usage.input_tokens" not in root.attributes  # never submitted
    assert root.span.status.code == Status.STATUS_CODE_UNSET  # the caller's fault, not ours


@pytest.mark.parametrize("header", [
    "not a traceparent",
    CALLER.upper(),  # hex must be lowercase
    f"00-{'0' * 32}-{PARENT_ID}-01",  # an all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",  # an all-zero parent id
    f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is invalid
    f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 has exactly four fields
    f"01-{TRACE_ID}-{PARENT_ID}-01-" + "x" * 300,  # over the cap
])
async def test_a_malformed_traceparent_is_ignored_and_starts_a_new_trace(
    receiver: OtlpReceiver, start_server: StartServer, header: str,
) -> None:
    server = await start_server(otlp_endpoint=receiver.url)
    async with server.client() as client:
        response = await client.post("/v1/generate", json={"prompt": "Hi", "max_new_tokens": 2},
                                     headers={"traceparent": header, "tracestate": "a=b"})
    assert response.status_code == 200

    (root,) = server_spans(await exported(server, receiver))
    assert root.parent_span_id == "" and root.trace_id not in (TRACE_ID, "0" * 32)
    assert root.span.trace_state == ""
    version, trace_id, span_id, flags = response.headers["traceresponse"].split("-")
    assert (version, trace_id, span_id) == ("00", root.trace_id, root.span_id)
    assert int(flags, 16) & 1  # sampled (the SDK's new traces also set bit 1, random)


def test_traceparent_parsing_follows_w3c() -> None:
    assert TraceParent.parse(CALLER) == TraceParent(TRACE_ID, PARENT_ID, 1)
    assert TraceParent.parse(CALLER).header() == CALLER  # type: ignore[union-attr]
    # A later version may add fields: its first four are read.
    assert TraceParent.parse(f"01-{TRACE_ID}-{PARENT_ID}-00-more") == \
        TraceParent(TRACE_ID, PARENT_ID, 0)
    for bad in (None, "", f"00-{TRACE_ID}-{PARENT_ID}", f"00-{TRACE_ID}-{PARENT_ID}-1",
                f"0-{TRACE_ID}-{PARENT_ID}-01", f"00-{TRACE_ID}x-{PARENT_ID}-01"):
        assert TraceParent.parse(bad) is None, bad
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("http://c/otlp/v1/traces") == "http://c/otlp/v1/traces"


async def test_a_stream_whose_client_left_is_a_cancelled_span(
    receiver: OtlpReceiver, start_server: StartServer,
) -> None:
    server = await start_server(otlp_endpoint=receiver.url)
    async with server.client() as client, client.stream(
            "POST", "/v1/stream", json={"prompt": "Hi", "max_new_tokens": 400,
                                        "ignore_eos": True}) as response:
        async for chunk in response.aiter_bytes():
            if b"event: token" in chunk:
                break  # leave after the first token
        request_id = response.headers["X-Request-ID"]
    registry = server.app.metrics.registry
    await server.wait_for(lambda: registry.get_sample_value(
        "streamscope_requests_finished_total", {"finish_reason": "cancelled"}) == 1,
        "its timer closed (and its record written)")

    (root,) = server_spans(await exported(server, receiver))
    assert root.attributes["gen_ai.response.id"] == request_id
    assert root.attributes["gen_ai.response.finish_reasons"] == ["cancelled"]
    assert 1 <= root.attributes["gen_ai.usage.output_tokens"] < 400


async def test_a_stream_cut_by_the_drain_is_exported_at_shutdown(
    receiver: OtlpReceiver, start_server: StartServer,
) -> None:
    server = await start_server(otlp_endpoint=receiver.url, graceful_timeout_s=0.2)
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(1)
    server.recorder.hold()  # the stream stays open past the grace period

    server.stop()
    await client.read_until(lambda events: events[-1].event == "error")
    server.recorder.release()
    await server.wait_stopped()  # no flush of ours: the app's own, after the drain

    (root,) = server_spans(receiver.spans())
    assert root.attributes["gen_ai.response.finish_reasons"] == ["shutdown"]
    assert root.span.status.code == Status.STATUS_CODE_ERROR


def test_with_no_endpoint_and_text_logs_nothing_of_opentelemetry_loads() -> None:
    code = (
        "import sys, json\n"
        "from app.factory import create_app\nfrom app.settings import Settings\n"
        "import app.routes, app.metrics, app.request_record\n"
        "off = create_app(Settings(model='tiny-gpt2'))\n"
        "loaded_off = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "on = create_app(Settings(model='tiny-gpt2', otlp_endpoint='http://127.0.0.1:9'))\n"
        "loaded_on = any(m.startswith('opentelemetry') for m in sys.modules)\n"
        "on.metrics.recorder.tracing.shutdown()\n"
        "print(json.dumps([off.metrics.recorder is None, loaded_off, loaded_on]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True, timeout=120)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [True, [], True]

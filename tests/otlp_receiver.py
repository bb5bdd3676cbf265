"""A real OTLP/HTTP trace receiver on a loopback port, for the tests and the tracing bench.

``POST /v1/traces`` with a protobuf body (``application/x-protobuf``, gzip or not): the
body is decoded with ``opentelemetry-proto``'s ``ExportTraceServiceRequest``, the wire
format every collector reads, and answered as a collector does (200, an empty
``ExportTraceServiceResponse``). Anything else is a 404 (and counted: a test can check
none came). The server runs in its own thread (``http.server``), as a collector runs in
its own process: the exporter's thread posts to it over real TCP.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass(frozen=True)
class ReceivedSpan:
    """One decoded span, its ids as hex, its attributes as Python values."""

    span: Span
    resource: dict[str, Any]

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_span_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict[str, Any]:
        return {kv.key: any_value(kv.value) for kv in self.span.attributes}

    def event(self, name: str) -> Any:
        """The span's one event of this name."""
        (found,) = [e for e in self.span.events if e.name == name]
        return found


def any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a Python value (arrays as lists)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


class OtlpReceiver:
    """The receiver: ``url`` is its base (what ``STREAMSCOPE_OTLP_ENDPOINT`` takes)."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.bad_requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces" or \
                        self.headers.get("Content-Type") != "application/x-protobuf":
                    receiver.bad_requests += 1
                    self.send_error(404)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver._lock:
                    receiver.requests.append(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            requests = list(self.requests)
        found: list[ReceivedSpan] = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = {kv.key: any_value(kv.value)
                            for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found.extend(ReceivedSpan(span, resource) for span in scope_spans.spans)
        return found

    @contextmanager
    def running(self) -> Iterator[OtlpReceiver]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join()


def main() -> None:
    """``python -m tests.otlp_receiver``: a receiver in its own process (so that a
    measurement in another one counts none of its decoding); prints its URL, then, once
    stdin closes, the number of spans it received."""
    import sys

    with OtlpReceiver().running() as receiver:
        print(receiver.url, flush=True)
        sys.stdin.read()
        print(len(receiver.spans()), flush=True)


if __name__ == "__main__":
    main()

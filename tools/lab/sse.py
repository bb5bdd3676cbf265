"""``sse``: what goes over the wire, and whether a reader gets back what was written.

The chapter's "The wire". For each of 40 streams of 32 tokens (the 32 prompts, then the
first 8 again; greedy, ending by eos or length), one at a time on an idle server: the
stream as received (``tools.load``, raw bytes kept), then ``/v1/generate`` with the same
body. Each stream is checked for:

* ``status`` 200 and ``content_type`` ``text/event-stream``;
* ``parsers_agree``: our ``SSEParser`` and httpx-sse read the same events (type, data,
  id, retry) from the body;
* ``round_trip``: every parsed event re-encoded with ``streams.sse.encode_event`` and
  parsed again gives the same events (``bytes_identical`` notes whether the re-encoding
  is byte for byte the body: it is unless a keep-alive comment came);
* ``complete``: nothing unfinished at the end (a blank line appended dispatches nothing);
* ``request_id``: the ``X-Request-ID`` header equals the start event's id;
* ``order``: start, tokens, done; ``ids``: event ids 1..n, so the last id is the number
  of events; ``indices``: token indices 0..k-1;
* ``usage``: done's usage agrees with the start event and the number of token events,
  and its ``cached_tokens`` (found in the prefix cache) are a part of the prompt's;
* ``live_parse``: the token ids parsed as the bytes arrived equal those of the body;
* ``matches_generate``: token ids, text, finish reason and usage equal ``/v1/generate``'s
  (but ``cached_tokens``: the second of the two finds the first's prompt cached).

Empty deltas (token events with ``"text": ""``) are counted, not failed: a character
split over several tokens gives them (the tiny test tokenizer does often).

Summary: ``bytes_per_token`` (all body bytes over all tokens, start and done events
included), ``bytes_per_token_range`` (per stream), ``streams_checked``, ``streams_ok``,
``round_trip_ok``, ``empty_deltas``, ``token_events``, and per check the streams that
passed it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx
import httpx_sse

from streams import ServerSentEvent, SSEParser, encode_event
from tools.lab.common import Lab, Report, experiment
from tools.load_runner import run_streams
from tools.records import StreamRecord, StreamRequest

CHECKS = (
    "status",
    "content_type",
    "parsers_agree",
    "round_trip",
    "complete",
    "request_id",
    "order",
    "ids",
    "indices",
    "usage",
    "live_parse",
    "matches_generate",
)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, help="default 40 (quick 6)")
    parser.add_argument("--max-new-tokens", type=int, help="default 32 (quick 8)")


@experiment(
    "sse",
    "bytes per token, and the SSE writer/parser round trip on the server's own output",
    arguments=arguments,
)
async def sse(lab: Lab) -> Report:
    count = lab.option("streams", 40, 6)
    tokens = lab.option("max_new_tokens", 32, 8)
    streams = []
    async with lab.client() as client:
        for prompt in lab.prompts(count):
            result = await run_streams(
                lab.url, [StreamRequest(prompt, tokens)], keep_raw=True, progress=False
            )
            answer = await client.post(
                "/v1/generate", json={"prompt": prompt, "max_new_tokens": tokens}
            )
            streams.append(check_stream(result.records[0], answer.json()))

    body_bytes = sum(s["bytes"] for s in streams)
    token_events = sum(s["tokens"] for s in streams)
    per_stream = [s["bytes"] / s["tokens"] for s in streams if s["tokens"]]
    summary = {
        "bytes_per_token": round(body_bytes / token_events, 2) if token_events else None,
        "bytes_per_token_range": (
            [round(min(per_stream), 1), round(max(per_stream), 1)] if per_stream else None
        ),
        "streams_checked": len(streams),
        "streams_ok": sum(s["ok"] for s in streams),
        "round_trip_ok": all(s["checks"]["round_trip"] for s in streams),
        "token_events": token_events,
        "empty_deltas": sum(s["empty_deltas"] for s in streams),
        "bytes_per_stream_p50": sorted(s["bytes"] for s in streams)[len(streams) // 2],
        "passed": {c: sum(s["checks"][c] for s in streams) for c in CHECKS},
        "finish_reasons": _count(s["finish_reason"] for s in streams),
    }
    return Report(summary, {"streams": streams})


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def parse_ours(raw: bytes) -> list[ServerSentEvent]:
    parser = SSEParser()
    return parser.feed(raw) + parser.close()


def parse_httpx_sse(raw: bytes, content_type: str) -> list[ServerSentEvent]:
    response = httpx.Response(200, headers={"content-type": content_type}, content=raw)
    return [
        ServerSentEvent(e.event, e.data, e.id, e.retry)
        for e in httpx_sse.EventSource(response).iter_sse()
    ]


def reencode(events: list[ServerSentEvent]) -> bytes:
    return b"".join(encode_event(e.data, event=e.event, id=e.id, retry=e.retry) for e in events)


def check_stream(record: StreamRecord, answer: dict[str, Any]) -> dict[str, Any]:
    """Every check of the module docstring on one stream, with the figures behind them."""
    raw = bytes(record.raw or b"")
    content_type = record.headers.get("content-type", "")
    events = parse_ours(raw)
    names = [e.event for e in events]
    data = [json.loads(e.data) for e in events]
    start = data[0] if names[:1] == ["start"] else {}
    done = data[-1] if names[-1:] == ["done"] else {}
    token_data = [d for e, d in zip(events, data, strict=True) if e.event == "token"]
    token_ids = [d["id"] for d in token_data]
    text = "".join(d["text"] for d in token_data)
    k = len(token_data)
    encoded = reencode(events)
    checks = {
        "status": record.status == 200,
        "content_type": content_type.startswith("text/event-stream"),
        "parsers_agree": events == parse_httpx_sse(raw, content_type),
        "round_trip": parse_ours(encoded) == events,
        "complete": raw.endswith(b"\n\n") and parse_ours(raw + b"\n\n") == events,
        "request_id": bool(start) and record.headers.get("x-request-id") == start.get("id"),
        "order": names == ["start"] + ["token"] * k + ["done"],
        "ids": [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)],
        "indices": [d["index"] for d in token_data] == list(range(k)),
        "usage": _usage_agrees(done.get("usage"), start.get("prompt_tokens"), k),
        "live_parse": record.token_ids == token_ids,
        "matches_generate": (
            answer.get("tokens"),
            answer.get("text"),
            answer.get("finish_reason"),
            _counted(answer.get("usage")),
        )
        == (token_ids, text, done.get("finish_reason"), _counted(done.get("usage"))),
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "request_id": start.get("id"),
        "events": len(events),
        "last_event_id": events[-1].id if events else None,
        "tokens": k,
        "bytes": len(raw),
        "bytes_identical": encoded == raw,
        "empty_deltas": sum(d["text"] == "" for d in token_data),
        "finish_reason": done.get("finish_reason"),
        "error": record.error,
    }


def _usage_agrees(usage: Any, prompt_tokens: Any, made: int) -> bool:
    """``done``'s usage: the start event's prompt tokens, ``made`` tokens, and no more
    cached tokens than the prompt has."""
    if not isinstance(usage, dict) or not isinstance(prompt_tokens, int):
        return False
    return (usage.get("prompt_tokens"), usage.get("completion_tokens")) == (
        prompt_tokens, made) and 0 <= usage.get("cached_tokens", -1) <= prompt_tokens


def _counted(usage: Any) -> Any:
    """``usage`` but its ``cached_tokens``, which depend on what ran before."""
    return {k: v for k, v in usage.items() if k != "cached_tokens"} if isinstance(
        usage, dict) else usage

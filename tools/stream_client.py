"""One stream of the load generator over HTTP: its request, its body read to the end, a
refusal sent again and a cut resumed.

``run_one_stream`` is what each client of ``tools/load_runner.py`` does per request; it
fills a ``StreamRecord`` through the stream's ``WireProtocol``. Which refusals are sent
again and which cuts are resumed (``Retries``) is the user's to know, so it is written in
``tools/load.py``'s docstring ("Retries"), not here.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from streams import SSEParser
from tools.records import StreamRecord
from tools.wire import WireProtocol

# Statuses that refuse a request before its first byte and may say when to try again
# (with Retry-After): a draining or overloaded server. 409 only for a resume (the
# stream's previous reader had not let go yet: "try again").
RETRYABLE_STATUSES = frozenset({429, 503})
RESUME_BUSY = 409
# A refusal's wait when it names none (a connection refused): a replica that is going
# away is out of its balancer's pool within a health check or two.
RETRY_WAIT_S = 0.1
# The longest Retry-After a client waits by default (a server asking for minutes is
# better reported than waited for in a load test).
RETRY_WAIT_CAP_S = 5.0


@dataclass(frozen=True, slots=True)
class Retries:
    """What a client tries again (see ``tools/load.py``'s docstring); the default: nothing."""

    refusals: int = 0  # sends again of a request refused before its first byte, per stream
    resumes: int = 0  # resumes of a resumable stream cut before its terminal event
    max_wait_s: float = RETRY_WAIT_CAP_S  # the cap on a Retry-After wait


class _Outcome(enum.Enum):
    """How one HTTP exchange of a stream ended."""

    OVER = "over"  # the terminal event came, or an error that is not tried again
    REFUSED = "refused"  # refused before its first byte, retryable (``wait`` says when)
    CUT = "cut"  # the body ended, or the connection broke, before the terminal event


async def run_one_stream(
    client: httpx.AsyncClient,
    wire: WireProtocol,
    record: StreamRecord,
    model: str | None,
    keep_raw: bool,
    count: Callable[[StreamRecord, int], None],
    retries: Retries,
) -> None:
    """Send one request and read its body to the end into ``record``, sending it again
    after a retryable refusal and resuming it after a cut, as ``retries`` allows.

    Cancellation: nothing to undo: httpx closes the connection (the server sees a
    disconnect); ``record`` keeps what arrived.
    """
    record.raw = bytearray() if keep_raw else None
    record.sent_at = time.perf_counter()
    body = wire.body(record.request, model)
    try:
        resuming = False
        while True:
            if resuming:
                assert record.resume_url is not None and record.last_event_id is not None
                outcome, wait = await _exchange(
                    client, wire, record, count, "GET", record.resume_url,
                    headers={"Last-Event-ID": record.last_event_id})
            else:
                outcome, wait = await _exchange(client, wire, record, count, "POST",
                                                wire.path, body=body)
            if outcome is _Outcome.OVER:
                break
            if outcome is _Outcome.REFUSED:
                if record.retries >= retries.refusals:
                    break  # record.error says what the last refusal was
                record.retries += 1
                record.retried.append(record.error or "refused")
                record.error = None
                await trio.sleep(min(wait, retries.max_wait_s))
                continue
            # CUT
            if (record.resumes >= retries.resumes or record.resume_url is None
                    or record.last_event_id is None):
                record.error = record.error or "the body ended without a terminal event"
                break
            record.resumes += 1
            record.retried.append(f"cut after {record.last_event_id}: "
                                  f"{record.error or 'the body ended'}")
            record.error = None
            resuming = True
    finally:
        if record.finished_at is None:
            record.finished_at = time.perf_counter()


async def _exchange(
    client: httpx.AsyncClient,
    wire: WireProtocol,
    record: StreamRecord,
    count: Callable[[StreamRecord, int], None],
    method: str,
    path: str,
    *,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[_Outcome, float]:
    """One request of a stream (its POST, or a resume's GET) and its body, read into
    ``record``; what happened, and for a retryable refusal how long to wait.

    Cancellation: nothing to undo: httpx closes the connection (the server sees a
    disconnect); ``record`` keeps what arrived.
    """
    parser = SSEParser()
    answered = False
    try:
        async with client.stream(method, path, json=body, headers=headers) as r:
            answered = True
            record.status, record.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                if r.status_code == 204 and method == "GET":
                    record.error = "resume: 204 (nothing to resume) before a terminal event"
                wait = _retry_after(r)
                if r.status_code in RETRYABLE_STATUSES and wait is not None:
                    return _Outcome.REFUSED, wait
                if r.status_code == RESUME_BUSY and method == "GET":
                    return _Outcome.REFUSED, RETRY_WAIT_S
                return _Outcome.OVER, 0.0
            if method == "POST" and "x-resume-url" in r.headers:
                record.resume_url = r.headers["x-resume-url"]
            async for chunk in r.aiter_raw():
                now = time.perf_counter()
                record.bytes += len(chunk)
                if record.raw is not None:
                    record.raw += chunk
                for event in parser.feed(chunk):
                    added = wire.on_event(record, event, now)
                    if event.id:
                        record.last_event_id = event.id
                    count(record, added)
    except httpx.ConnectError as exc:  # nothing was sent: refused, or no route
        record.error = f"{type(exc).__name__}: {exc}"
        return _Outcome.REFUSED, RETRY_WAIT_S
    except (httpx.TransportError, httpx.DecodingError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        if answered and record.request.resumable and record.finish_reason is None:
            return _Outcome.CUT, 0.0
        return _Outcome.OVER, 0.0
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        record.error = record.error or f"{type(exc).__name__}: {exc}"
        return _Outcome.OVER, 0.0
    if record.error is None and record.finish_reason is None:
        if record.request.resumable:
            return _Outcome.CUT, 0.0
        record.error = "the body ended without a terminal event"
    return _Outcome.OVER, 0.0


def _retry_after(response: httpx.Response) -> float | None:
    """The seconds of a ``Retry-After: <seconds>`` header, or None (absent, or a date)."""
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None

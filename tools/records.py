"""What the load generator asks for, what it records of one stream, and of a whole run.

``StreamRequest`` is one stream to open; ``StreamRecord`` what it did (tokens, times,
bytes, retries); ``LoadResult`` every stream of one run, with the aggregate figures
(``summary()``) that ``tools/load.py`` documents. ``tools/wire.py`` fills a record from
a protocol's events and ``tools/load_runner.py`` runs the streams; both import these
types from here, so neither imports the other, and a caller that only reads results
needs neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """One stream to open. ``at_s``: send it this long after the start, not at once."""

    prompt: str
    max_new_tokens: int
    ignore_eos: bool = False
    at_s: float | None = None
    tag: str = ""  # a label for the experiment's own use ("long", "joiner", ...)
    resumable: bool = False  # ask for a resumable stream (streamscope only)


@dataclass(slots=True)
class StreamRecord:
    """What one stream did. Times are ``time.perf_counter()`` seconds."""

    index: int
    client: int
    request: StreamRequest
    sent_at: float | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    request_id: str | None = None  # from the start event (streamscope)
    prompt_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)  # streamscope only
    texts: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None  # the terminal event arrived (or the body ended)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    bytes: int = 0
    error: str | None = None
    raw: bytearray | None = None  # the body as received, when asked for
    retries: int = 0  # refusals sent again
    resumes: int = 0  # cuts resumed
    retried: list[str] = field(default_factory=list)  # what each retry and resume was for
    resume_url: str | None = None  # X-Resume-URL of a resumable stream
    last_event_id: str | None = None  # the id of the last event received

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        if self.sent_at is None or not self.token_times:
            return None
        return self.token_times[0] - self.sent_at

    @property
    def duration_s(self) -> float | None:
        if self.sent_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.sent_at

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    def add_token(self, token_id: int | None, text: str, now: float) -> None:
        if token_id is not None:
            self.token_ids.append(token_id)
        self.texts.append(text)
        self.token_times.append(now)

    def to_json(self, origin: float) -> dict[str, Any]:
        """Plain data; times in ms from ``origin`` (the run's start)."""

        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - origin) * 1000, 2)

        ttft = self.ttft_s
        return {
            "index": self.index,
            "client": self.client,
            "tag": self.request.tag,
            "prompt": self.request.prompt[:40],
            "status": self.status,
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "retries": self.retries,
            "resumes": self.resumes,
            "retried": self.retried,
            "usage": self.usage,
            "bytes": self.bytes,
            "sent_ms": ms(self.sent_at),
            "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
            "finished_ms": ms(self.finished_at),
            "token_ids": self.token_ids,
            "token_ms": [ms(t) for t in self.token_times],
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), or None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


@dataclass(slots=True)
class LoadResult:
    """Every stream of one run; ``summary()`` gives the aggregate figures."""

    protocol: str
    records: list[StreamRecord]
    started_at: float  # the barrier opened

    def summary(self) -> dict[str, Any]:
        sent = [r.sent_at for r in self.records if r.sent_at is not None]
        ends = [r.finished_at for r in self.records if r.finished_at is not None]
        makespan = max(ends) - min(sent) if sent and ends else None
        tokens = sum(r.tokens for r in self.records)
        ttfts = [t for r in self.records if (t := r.ttft_s) is not None]
        gaps = [g for r in self.records for g in r.gaps_s()]
        body_bytes = sum(r.bytes for r in self.records)
        return {
            "streams": len(self.records),
            "streams_ok": sum(r.ok for r in self.records),
            "errors": sum(r.error is not None for r in self.records),
            # ok in the end, after a refusal sent again / after a cut resumed
            "retried_ok": sum(r.ok and r.retries > 0 for r in self.records),
            "resumed_ok": sum(r.ok and r.resumes > 0 for r in self.records),
            "tokens": tokens,
            "makespan_s": None if makespan is None else round(makespan, 4),
            "tokens_per_s": round(tokens / makespan, 2) if makespan else None,
            "ttft_p50_ms": _ms(percentile(ttfts, 50)),
            "ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "gap_p50_ms": _ms(percentile(gaps, 50)),
            "gap_p99_ms": _ms(percentile(gaps, 99)),
            "bytes_per_token": round(body_bytes / tokens, 2) if tokens else None,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "protocol": self.protocol,
            "streams": [r.to_json(self.started_at) for r in self.records],
        }

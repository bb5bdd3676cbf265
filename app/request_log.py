"""The request log: one JSON line per request, and JSON for every streamscope log line.

Owns the line's fields and the JSON format; ``request_record.py`` says when a request
is done. ``STREAMSCOPE_LOG_FORMAT=json`` turns both on; ``text`` (the default, for a
terminal) keeps the server's lines as they were and writes no line per request.

A request's line, on the ``streamscope.requests`` logger at INFO, message ``request``:

    request_id   the stream's id (null if it never opened: refused, or its client left)
    key          the API key's name (null on a server without keys)
    route        the route's rule (``/v1/chat/completions``, ``/v1/requests/<request_id>``)
    status       the HTTP status sent (200 for a stream, even one that ended with an error
                 event; null when no response went out, or for a failover's rebuild)
    prompt_tokens, output_tokens   the prompt's tokens (null if never submitted) and the
                 tokens taken for the client
    ttft_s       arrival -> the first token taken (null without one)
    duration_s   arrival -> the ending (or the response, for a refusal)
    finish       eos, length, stop, cancelled, or the error type that ended it
    replica      ``STREAMSCOPE_REPLICA``, else the host's name
    trace_id, span_id   the request's span's (with an OTLP endpoint), else the trace of
                 the caller's ``traceparent``; null without either

Never a prompt, an output, a header's value or a key: only the names and numbers above.
The lines are written by the logging module's handler on the Trio thread, as every log
line of the server is (a short write to stderr).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOGGER = "streamscope.requests"
FIELDS = "streamscope_fields"  # the LogRecord attribute that carries a line's fields


class RequestLog:
    """Writes each finished request's line (its fields: ``RequestRecord.fields``)."""

    def __init__(self) -> None:
        self._logger = logging.getLogger(LOGGER)

    def write(self, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(logging.INFO):
            self._logger.info("request", extra={FIELDS: fields})


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, then the
    line's fields if it has any, and a traceback as ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, FIELDS, None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on whatever ``sys.stderr`` is when it writes (not when it was made)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def install_json_logging() -> None:
    """The ``streamscope`` loggers' lines as JSON (idempotent): every handler the
    ``streamscope`` logger has (``streamscope serve``'s, on stderr: ``app/cli.py``)
    gets the JSON formatter; with none (``hypercorn -k trio app:app`` configures no
    logging of ours), one on stderr is added. hypercorn's own lines keep its format."""
    logger = logging.getLogger("streamscope")
    if not logger.handlers:
        logger.addHandler(StderrHandler())
    for handler in logger.handlers:
        if not isinstance(handler.formatter, JsonFormatter):
            handler.setFormatter(JsonFormatter())
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.propagate = False

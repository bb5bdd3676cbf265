"""ErrorType: what the server names in a refusal's envelope and a stream's error event.

One enum for both sides: ``streams/`` ends a stream with some of them (``StreamError``),
``app/`` refuses a request with the others and chooses each one's HTTP status
(``app/errors.py``). Plain data: it knows no HTTP and no Trio.
"""

from __future__ import annotations

import enum


class ErrorType(enum.StrEnum):
    """What went wrong: a refusal envelope's ``type`` (``app/errors.py``'s ``STATUS`` gives
    each its HTTP status) or a stream's ``error`` event's (``StreamError.type``)."""

    UNAUTHORIZED = "unauthorized"  # STREAMSCOPE_API_KEY is set; no or a wrong bearer token
    INVALID_JSON = "invalid_json"  # the body is not a JSON document
    INVALID_REQUEST = "invalid_request"  # a field is missing, unknown, mistyped or out of range
    # a request's constraint does not compile, or costs too much (engine/constraint_costs.py)
    INVALID_CONSTRAINT = "invalid_constraint"
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_new_tokens exceed the token budget
    BODY_TOO_LARGE = "body_too_large"  # over MAX_BODY_BYTES, by Content-Length or as read
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # a body not sent as application/json
    NOT_FOUND = "not_found"  # no such route
    MODEL_NOT_FOUND = "model_not_found"  # an OpenAI route's `model` names no model served here
    METHOD_NOT_ALLOWED = "method_not_allowed"  # the route exists; the method does not
    REQUEST_TIMEOUT = "request_timeout"  # the body did not arrive in time
    BAD_REQUEST = "bad_request"  # any other malformed HTTP request
    TOO_MANY_WAITING = "too_many_waiting"  # MAX_WAITING streams wait for a first token
    TOO_MANY_STREAMS = "too_many_streams"  # the API key holds its max_streams open already
    TOO_MANY_DETACHED = "too_many_detached"  # MAX_DETACHED_STREAMS generate with no reader
    KEY_LIMIT = "key_limit"  # the API key holds its fair share of a server-wide cap
    TOO_MANY_WATCHERS = "too_many_watchers"  # /scope/events: the key's or the server's cap
    TOO_MANY_STORED = "too_many_stored"  # the API key's stored responses are at their bound
    DEADLINE_UNMEETABLE = "deadline_unmeetable"  # the first token is estimated past deadline_ms
    DEADLINE_MISSED = "deadline_missed"  # waited past deadline_ms, never run (SSE error)
    NOT_READY = "not_ready"  # the model is still loading
    SHUTDOWN = "shutdown"  # the server is stopping (also the SSE error of a cut stream)
    UNAVAILABLE = "unavailable"  # the engine failed; the server cannot serve
    SLOW_CLIENT = "slow_client"  # the reader stayed behind too long (SSE error)
    ENGINE_ERROR = "engine_error"  # the engine failed this request (SSE error)
    STREAM_BUSY = "stream_busy"  # the resumable stream's old reader did not let go in time
    TAKEN_OVER = "taken_over"  # a newer reader took this resumable stream over (SSE error)
    RESUME_LOG_FULL = "resume_log_full"  # detached, its log passed the server's cap (SSE error)
    INTERNAL_ERROR = "internal_error"  # a bug: logged with its traceback

"""The limits every request body shares, written once for the native and OpenAI bodies.

Two kinds of limit:

* fixed ones, as pydantic field types (``Prompt``, ``NewTokens``, ``Temperature``,
  ``TopP``, ``Seed``, ``StopStrings``, ``DeadlineMs``): the sampling ranges are the engine's own
  (``engine.MAX_TEMPERATURE``, ``engine.MAX_SEED``, ...), so a value the engine would
  refuse is a 422 naming the field before anything reaches the engine;
* the server's, from settings (``RequestLimits``, passed as pydantic's validation
  context): the prompt's length, the number of new tokens, the tools and the schemas a
  request may have compiled, checked by ``check_prompt_chars``, ``check_new_tokens``,
  ``check_tool_count`` and ``check_schema_bytes`` (both: ``check_tools_within_limit``),
  whose messages are worded here only; ``new_tokens_validator`` is the bodies' one
  validator of their new-token fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from engine import (
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_P,
    MIN_SEED,
    MIN_TEMPERATURE,
    MIN_TOP_P,
)
from streams import PolicyName

if TYPE_CHECKING:
    from app.settings import Settings

# Stop strings are matched against every token's text; a few short ones cover real use
# (OpenAI allows 4) and keep the matcher's per-token work small.
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
# The longest constraint source (a schema's JSON, a regex, a grammar) a request may send:
# compiling costs time in proportion to it. (A constant until app/settings.py, at its
# line cap, has room for a setting.)
MAX_CONSTRAINT_CHARS = 16_384
# The longest TTFT deadline a request may give: ten minutes is already no deadline.
MAX_DEADLINE_MS = 600_000.0

Prompt = Annotated[str, Field(min_length=1)]  # the server's length limit: check_prompt_chars
NewTokens = Annotated[int, Field(ge=1)]  # the server's limit: check_new_tokens
Temperature = Annotated[
    float, Field(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False)
]
TopP = Annotated[float, Field(gt=MIN_TOP_P, le=MAX_TOP_P, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
# The first token is due this long after the request arrived, or it is refused
# (429 deadline_unmeetable) or let go (deadline_missed).
DeadlineMs = Annotated[float, Field(gt=0.0, le=MAX_DEADLINE_MS, allow_inf_nan=False)]
# vLLM's cache_salt: requests of one API key share cached prompt blocks only if they give
# the same salt (or none). Visible ASCII and spaces, so that its bytes are its characters
# and fit the engine's namespace bound until auth binds it to the key (auth.owned_request).
MAX_CACHE_SALT_CHARS = 64
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS,
                                 pattern=r"^[ -~]+$")]


def salt_bytes(salt: str | None) -> bytes:
    """What a body's ``cache_salt`` puts in ``GenerationRequest.cache_namespace`` (b"" for
    none); ``auth.owned_request`` then replaces it with the key's namespace for it."""
    return b"" if salt is None else salt.encode("ascii")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The server's limits on one request, from settings."""

    max_prompt_chars: int
    # The operator's cap on new tokens and their default (None: the model's context, and
    # what it leaves after the prompt; app/new_tokens.py applies both once it is encoded).
    max_new_tokens_limit: int | None
    default_max_new_tokens: int | None
    # The policies a request may pick (STREAMSCOPE_REQUEST_POLICIES).
    request_policies: frozenset[PolicyName]
    # Chat requests: messages and text parts, each a template pass's work (issue 33).
    max_chat_messages: int = 512
    max_content_parts: int = 1024
    max_constraint_chars: int = MAX_CONSTRAINT_CHARS
    # The OpenAI and Anthropic routes' tools and schemas (STREAMSCOPE_MAX_TOOLS,
    # STREAMSCOPE_MAX_SCHEMA_BYTES): what a request may ask the engine to compile.
    max_tools: int = 64
    max_schema_bytes: int = 32 * 1024

    @classmethod
    def from_settings(cls, settings: Settings) -> RequestLimits:
        return cls(
            max_prompt_chars=settings.max_prompt_chars,
            max_new_tokens_limit=settings.max_new_tokens_limit,
            default_max_new_tokens=settings.default_max_new_tokens,
            request_policies=settings.request_policies,
            max_chat_messages=settings.max_chat_messages,
            max_content_parts=settings.max_content_parts,
            max_tools=settings.max_tools,
            max_schema_bytes=settings.max_schema_bytes,
        )


def limits_of(info: ValidationInfo, how: str) -> RequestLimits:
    """The ``RequestLimits`` a body was validated with; ``how`` says, in the error
    raised without them, how that body is meant to be validated."""
    if not isinstance(info.context, RequestLimits):
        raise TypeError(how)
    return info.context


def check_prompt_chars(length: int, limits: RequestLimits) -> None:
    """Refuse a prompt (or the messages' text) longer than the server allows."""
    limit = limits.max_prompt_chars
    if length > limit:
        raise PydanticCustomError(
            "over_limit",
            "the prompt has {length} characters, over the limit of {limit}",
            {"length": length, "limit": limit},
        )


def check_chat_size(messages: int, parts: int, limits: RequestLimits) -> None:
    """Refuse more chat messages, or text parts, than the server allows: each costs the
    chat template's work on the one tokenizer slot, before any token is counted."""
    for what, count, limit in (("messages", messages, limits.max_chat_messages),
                               ("text parts", parts, limits.max_content_parts)):
        if count > limit:
            raise PydanticCustomError(
                "over_limit", "the request has {count} {what}, over the limit of {limit}",
                {"count": count, "what": what, "limit": limit})


def check_top_logprobs(value: int | None, logprobs: object) -> int | None:
    """Refuse top log-probabilities without ``logprobs`` (as OpenAI does)."""
    if value and logprobs is not True:
        raise PydanticCustomError("logprobs_required",
                                  "top_logprobs needs logprobs set to true", {})
    return value


def check_tool_count(count: int, limits: RequestLimits) -> None:
    """Refuse more tools than the server allows in one request."""
    if count > limits.max_tools:
        raise PydanticCustomError(
            "over_limit", "{count} tools, over this server's limit of {limit} per request",
            {"count": count, "limit": limits.max_tools})


def check_schema_bytes(schemas: object, limits: RequestLimits, what: str) -> None:
    """Refuse a schema (or the tools' schemas together) longer, as compact JSON, than
    the server compiles: a constraint's compile time and size grow with it."""
    size = len(json.dumps(schemas, separators=(",", ":")).encode())
    if size > limits.max_schema_bytes:
        raise PydanticCustomError(
            "over_limit",
            "{what} take {size} bytes as compact JSON, over this server's limit of {limit}",
            {"what": what, "size": size, "limit": limits.max_schema_bytes})


def check_tools_within_limit(schemas: list[Any], limits: RequestLimits, what: str) -> None:
    """Refuse more tools than the server allows, or their argument ``schemas`` (``what``
    names them in the refusal) together longer than it compiles."""
    check_tool_count(len(schemas), limits)
    check_schema_bytes(schemas, limits, what)


def check_new_tokens(value: int | None, limits: RequestLimits) -> int | None:
    """Refuse more new tokens than the operator allows; None (the default) passes. The
    model's context, which the prompt shares, is checked once the prompt is encoded
    (``app/new_tokens.py``)."""
    limit = limits.max_new_tokens_limit
    if value is not None and limit is not None and value > limit:
        raise PydanticCustomError("over_limit", "must be at most {limit}", {"limit": limit})
    return value


def new_tokens_validator(how: str, *fields: str) -> Any:
    """A field validator of a body's new-token ``fields`` (``max_tokens``, ...): each
    within the operator's cap (``check_new_tokens``); ``how`` as ``limits_of``'s.
    Assign it in the class body, under a name of its own in each class (a subclass's
    validator of the same name would replace its base's)."""

    def within_limit(cls: Any, value: int | None, info: ValidationInfo) -> int | None:
        return check_new_tokens(value, limits_of(info, how))

    return field_validator(*fields)(classmethod(within_limit))  # type: ignore[arg-type]

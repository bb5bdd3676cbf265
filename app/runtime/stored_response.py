"""A stored response (``POST /v1/responses`` with ``store``), as one frozen, typed record.

What the Responses API keeps of a response, and what every replica reads back the same:

- ``created``: the response object as created (``queued`` or ``in_progress``, its output
  empty): what its events are made from, so that a background response's events, made
  again from its log on any replica, are the same events (``app.wire.responses_replay``);
- ``response``: the response object as it stands (final once the response ended);
- ``input_items``: this request's own input items, each with its id
  (``GET /v1/responses/<id>/input_items``);
- ``context``: the items of the whole conversation before this response's output (a
  previous response's context and output, then this input): what a next turn's
  ``previous_response_id`` continues;
- ``owner``: the name of the API key it is counted under (the store's bounds);
- ``parser``: how the model's text becomes output (``OutputParsing``).

The record is frozen: a new state of the response is a new record (``with_response``),
never a change to one a writer may be storing. Its JSON form (``to_json``, read back by
``from_json``) is what the response stores keep, the same object the untyped documents
were, so a store's bytes and bounds count the same. The JSON values inside it (the
response objects and items) are plain dicts and lists, as the wire takes them; nobody
changes them in place (an encoder copies ``created`` before it fills it in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

JsonObject = dict[str, Any]
# The generic tool format's name (``app.schemas.tool_formats.GENERIC``: a test checks
# they agree; this package does not import the schemas).
GENERIC_CALLS = "generic"


@dataclass(frozen=True, slots=True)
class OutputParsing:
    """How the model's text becomes a response's output: function calls, when the request
    offered tools (``call_prefix``: the calls' ids are ``<call_prefix>_<index>``), in
    ``call_format`` (the tool format's name, ``app.schemas.tool_formats``: the generic
    one, or the model's own), else text, with its log-probabilities if the request asked
    for them. Every reader of the record (the foreground answer, a background response's
    runner, a retrieve, a replica's replay) parses the calls the same way of it."""

    logprobs: bool = False
    call_prefix: str | None = None
    call_format: str = GENERIC_CALLS

    def to_json(self) -> JsonObject:
        """The JSON form: ``{"logprobs": bool, "tools": <call prefix> | false}``, with
        ``"format": <call format>`` where there are calls (a record without it, stored
        before there were formats, is generic)."""
        value: JsonObject = {"logprobs": self.logprobs, "tools": self.call_prefix or False}
        if self.call_prefix is not None:
            value["format"] = self.call_format
        return value

    @classmethod
    def from_json(cls, value: JsonObject) -> OutputParsing:
        tools = value.get("tools")
        call_format = value.get("format")
        return cls(logprobs=bool(value.get("logprobs")),
                   call_prefix=tools if isinstance(tools, str) and tools else None,
                   call_format=call_format if isinstance(call_format, str) and call_format
                   else GENERIC_CALLS)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response (see the module docstring)."""

    created: JsonObject
    response: JsonObject
    input_items: tuple[JsonObject, ...]
    context: tuple[JsonObject, ...]
    owner: str
    parser: OutputParsing

    @property
    def id(self) -> str:
        """The response's id (``resp_<request id>``)."""
        return str(self.response["id"])

    @property
    def is_stored(self) -> bool:
        """The request asked for it to be stored (``store``, by default true)."""
        return bool(self.created["store"])

    @property
    def is_background(self) -> bool:
        return bool(self.response["background"])

    def with_response(self, response: JsonObject) -> StoredResponse:
        """The same record with the response object as it now stands."""
        return replace(self, response=response)

    def to_json(self) -> bytes:
        """The form the stores keep: one compact UTF-8 JSON object."""
        return json.dumps({
            "created": self.created, "response": self.response,
            "input_items": list(self.input_items), "context": list(self.context),
            "owner": self.owner, "parser": self.parser.to_json(),
        }, ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        """The record of its stored form.

        Raises:
            ValueError: ``data`` is not a stored response's JSON form (json's
                ``JSONDecodeError`` is one; so is a missing or mistyped field).
        """
        try:
            value = json.loads(data)
            return cls(created=_object(value["created"]), response=_object(value["response"]),
                       input_items=tuple(map(_object, value["input_items"])),
                       context=tuple(map(_object, value["context"])),
                       owner=str(value["owner"]),
                       parser=OutputParsing.from_json(_object(value["parser"])))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a stored response: {exc!r}") from exc


def _object(value: Any) -> JsonObject:
    if not isinstance(value, dict):
        raise TypeError(f"a JSON object was expected, not {type(value).__name__}")
    return value

"""The Responses API's objects: the response object as created, and the events' encoder
made of a stored response, the same on every replica.

A stored response is a ``StoredResponse`` (``app.runtime``: the response object as
created and as it stands, its input items with ids, the conversation it continues, its
owner and how its text becomes output). The encoder of a response (``events_of``) is a
function of the record alone: its output items' ids count from the response's id, so a
background response's events, made again from its log on any replica, are the same
events (``app.wire.responses_replay``). Where nobody reads the events, only the response
object they build (a background response's final record, a whole answer, a ``GET`` of a
background response not final in the store), the encoder makes no event's bytes
(``object_of``): a response's events are encoded for their readers only, once each.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ApiError, ErrorType
from ..runtime import OutputParsing, StoredResponse
from ..schemas import ResponsesBody
from ..wire import OutputParser, PlainText, ResponseEvents, ToolCalls

RESPONSE_PREFIX = "resp_"
FINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})
MAX_ID_CHARS = 128
# ``skip_through`` of an encoder whose events nobody reads: every event is skipped, so
# none is framed or JSON-encoded; the response object is built all the same.
NO_EVENTS = sys.maxsize


def response_id_of(request_id: str) -> str:
    return RESPONSE_PREFIX + request_id


def request_id_of(response_id: str) -> str:
    """The stream's id in a response id (``resp_<request id>``).

    Raises: ApiError 404 not_found for an id that is not one of ours.
    """
    request_id = response_id.removeprefix(RESPONSE_PREFIX)
    if (request_id == response_id or not request_id or len(response_id) > MAX_ID_CHARS
            or not (request_id.isascii() and request_id.isalnum())):
        raise not_found(response_id)
    return request_id


def not_found(response_id: str) -> ApiError:
    return ApiError(ErrorType.NOT_FOUND, f"no response {response_id[:MAX_ID_CHARS]!r}: "
                    "unknown, expired, deleted, or made with another API key")


def new_response(response_id: str, body: ResponsesBody, model: str, *, created_at: int,
                 max_output_tokens: int, service_tier: str = "default") -> dict[str, Any]:
    """The response object as created: ``queued`` in the background (nothing runs it
    yet), else ``in_progress``, as OpenAI's ``response.created`` shows them;
    ``service_tier``: the tier that serves it (``priority_bands.openai_tier``)."""
    fmt = body.text.format if body.text is not None else None
    text_format: dict[str, Any] = ({"type": "text"} if fmt is None else
                                   fmt.model_dump(mode="json", exclude_none=True,
                                                  by_alias=True))
    choice = body.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created_at,
        "status": "queued" if body.background else "in_progress",
        "background": bool(body.background), "error": None,
        "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": max_output_tokens, "model": model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": service_tier,
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format, "verbosity": "medium"},
        "tool_choice": (choice.model_dump(mode="json") if choice is not None
                        and not isinstance(choice, str) else choice or "auto"),
        "tools": [t.model_dump(mode="json") for t in body.tools or ()],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled", "usage": None, "metadata": dict(body.metadata or {}),
        "user": None,
    }


def with_ids(response_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items, each with an id (its own, else one made from the response's)."""
    base = response_id.removeprefix(RESPONSE_PREFIX)
    out = []
    for i, item in enumerate(items):
        prefix = {"function_call": "fc", "function_call_output": "fco"}.get(
            item.get("type", "message"), "msg")
        out.append({"id": f"{prefix}_{base}_in{i}", **item})
    return out


def id_maker(response_id: str) -> Callable[[str], str]:
    """The output items' ids of one response, the same every time it is encoded."""
    base = response_id.removeprefix(RESPONSE_PREFIX)
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{base}_{next(counter)}"


def parser_of(parsing: OutputParsing) -> OutputParser:
    """What the model's text becomes, as the record says: function calls or text, in its
    tool format (its ``call_prefix``: the calls' id prefix), or text."""
    if parsing.call_prefix is not None:
        return ToolCalls(parsing.call_prefix, parsing.call_format)
    return PlainText(with_logprobs=parsing.logprobs)


def events_of(record: StoredResponse, *, skip_through: int = -1,
              on_final: Callable[[dict[str, Any]], None] | None = None) -> ResponseEvents:
    """The encoder of the response a record holds, from its response as created."""
    created = dict(record.created)
    created["output"] = []
    return ResponseEvents(created, parser_of(record.parser), id_maker(created["id"]),
                          skip_through=skip_through, on_final=on_final)


def object_of(record: StoredResponse, *,
              on_final: Callable[[dict[str, Any]], None] | None = None) -> ResponseEvents:
    """An encoder of the record's response that makes no event's bytes (``NO_EVENTS``),
    only the response object as the items come (``.response``; ``on_final`` told of it
    once final): for the record's final state, where the events themselves go to no
    reader. The parser still reads every token (the output items are its work)."""
    return events_of(record, skip_through=NO_EVENTS, on_final=on_final)

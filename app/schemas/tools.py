"""Tool calls for any chat template: the generic format, its prompt and its output schema.

The embedded SmolLM2's chat template knows no tools (it renders no ``tools`` variable),
nor do most small models'. For every model this server uses one format, llama.cpp's
"generic" one (``common_chat_params_init_generic`` in its ``common/chat.cpp``):

* the tool definitions go into the system turn as text (``system_text``): a line saying
  how to answer, then the tools as one JSON array of ``{"name", "description",
  "parameters"}``;
* the answer is constrained to one JSON object (``output_schema``): ``{"tool_calls":
  [{"name": <a tool's name>, "arguments": <its parameters' schema>}, ...]}`` when a call
  is required (``required``, a named function: only that function's item), and with
  ``auto`` either that or ``{"response": "<text>"}`` (``anyOf``); ``parallel_tool_calls:
  false`` gives ``maxItems: 1``, and so does a named function whatever
  ``parallel_tool_calls`` says (OpenAI and vLLM call it exactly once; a small model asked
  of two cities called it twice); with a ``response_format`` the response is a document of
  its schema instead of a string (its JSON text is the answer's content). Unlike
  llama.cpp, the model writes no call id: the server gives each call its own
  (``call_...``, ``toolu_...``);
* the turns of a past round trip are rendered back in the same format, so the model reads
  its own calls as it wrote them: an assistant turn's calls as ``{"tool_calls": [...]}``
  (``calls_text``) and a tool's result as a user turn ``{"tool_response": {"tool_call_id",
  "name", "content"}}`` (``result_text``; a user turn because many templates know no
  ``tool`` role, as minja's polyfill does it).

A template that does know tools in a family's syntax (Hermes and Qwen 2.5's
``<tool_call>``, Llama 3.1's JSON, Mistral's ``[TOOL_CALLS]``) is given them through
``apply_chat_template(tools=...)`` and answers in its own syntax instead
(``tool_formats.py``: ``ToolUse.format`` says which); the Responses route, and any
template that knows no tools, use this generic format (docs/structured-output.md).

Pure: JSON in, JSON and text out; the routes' bodies (``openai.py``, ``anthropic.py``)
build a ``ToolUse`` from their fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine import Constraint, ConstraintKind

ANSWER_FORMAT = ('Answer with one JSON object: {"tool_calls": [{"name": <tool name>, '
                 '"arguments": <its parameters>}]} to call tools')
RESPONSE_FORMAT = ', or {"response": "<your answer>"} to answer the user'


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function the model may call: its name, what it does, its arguments' schema."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]


def function_spec(name: str, description: str | None,
                  parameters: Mapping[str, Any] | None) -> ToolSpec:
    """An OpenAI-shaped function (chat's ``function``, a Responses ``function`` tool) as
    a ``ToolSpec``. Without ``parameters`` (OpenAI lets them be left out) it takes no
    arguments: an empty object's schema, a fresh one each time (a spec's schema is the
    caller's to show and bound)."""
    if parameters is None:
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    return ToolSpec(name, description, parameters)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request asks of the tools it offers (``tool_choice`` none: no ToolUse).

    Args:
        tools: the functions offered, all shown to the model.
        required: a call must be made (``required``, ``any``, a named function).
        named: the one function that must be called, or None.
        parallel: more than one call allowed in the answer (never with ``named``).
        response_schema: what a ``response`` must be instead of a string (OpenAI's
            ``response_format``, as llama.cpp takes it), or None.
        format: the format the answer is in: ``generic`` (this module's), or the
            model's own (``tool_formats.py``), which the request speaks where its
            template renders ``tools``.
    """

    tools: tuple[ToolSpec, ...]
    required: bool = False
    named: str | None = None
    parallel: bool = True
    response_schema: Mapping[str, Any] | None = None
    format: str = "generic"

    def callable_tools(self) -> tuple[ToolSpec, ...]:
        """The tools the answer may call: the named one, or all."""
        if self.named is None:
            return self.tools
        return tuple(t for t in self.tools if t.name == self.named)


def system_text(use: ToolUse) -> str:
    """The system turn's part about tools: how to answer, then the tools."""
    listing = json.dumps([_definition(t) for t in use.tools], ensure_ascii=False,
                         separators=(",", ":"))
    how = ANSWER_FORMAT
    if use.named is not None:
        how += f"; call {json.dumps(use.named)}"
    elif not use.required:
        how += RESPONSE_FORMAT
    return f"{how}.\nTools: {listing}"


def with_system_text(messages: Sequence[Mapping[str, str]], text: str) -> list[dict[str, str]]:
    """``messages`` with ``text`` appended to the system turn (one made first if none)."""
    turns = [dict(m) for m in messages]
    if turns and turns[0].get("role") == "system":
        first = turns[0]["content"]
        turns[0]["content"] = f"{first}\n\n{text}" if first else text
        return turns
    return [{"role": "system", "content": text}, *turns]


def output_schema(use: ToolUse) -> dict[str, Any]:
    """The JSON schema every answer of ``use`` must match (the module docstring)."""
    items = [_call_schema(t) for t in use.callable_tools()]
    calls: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if not use.parallel or use.named is not None:  # a named function: exactly one call
        calls["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": calls},
            "required": ["tool_calls"], "additionalProperties": False}
    if use.required:
        return call
    answer = {"type": "string"} if use.response_schema is None else use.response_schema
    response = {"type": "object", "properties": {"response": answer},
                "required": ["response"], "additionalProperties": False}
    return {"anyOf": [call, response]}


def output_constraint(use: ToolUse) -> Constraint:
    """``output_schema`` as the engine's constraint."""
    return json_schema_constraint(output_schema(use))


def json_schema_constraint(schema: Mapping[str, Any] | bool) -> Constraint:
    """A JSON schema as the engine's constraint (its compact JSON text: the cache key)."""
    return Constraint(ConstraintKind.JSON_SCHEMA,
                      json.dumps(schema, ensure_ascii=False, separators=(",", ":")))


# How a turn's past calls are written: ``calls_text`` here, a family's in
# ``tool_formats.calls_writer``.
CallsText = Callable[[Sequence[tuple[str, Any]], str], str]


def calls_text(calls: Sequence[tuple[str, Any]], text: str = "") -> str:
    """An assistant turn's past calls, ``(name, arguments)`` each, in the answer's format;
    ``text``, what the turn also said, before them."""
    document = json.dumps({"tool_calls": [{"name": name, "arguments": arguments}
                                          for name, arguments in calls]},
                          ensure_ascii=False)
    return f"{text}\n{document}" if text else document


def result_text(tool_call_id: str | None, name: str | None, content: str,
                is_error: bool = False) -> str:
    """A tool's result, as the user turn that carries it."""
    result: dict[str, Any] = {}
    if tool_call_id:
        result["tool_call_id"] = tool_call_id
    if name:
        result["name"] = name
    result["content"] = content
    if is_error:
        result["is_error"] = True
    return json.dumps({"tool_response": result}, ensure_ascii=False)


def arguments_value(arguments: str) -> Any:
    """A past call's ``arguments`` string (OpenAI's) as JSON, or the string itself if it
    is not JSON (a client may send anything there). ValueError, not JSONDecodeError
    alone: a number of thousands of digits raises a plain ValueError (Python's int max
    str digits)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _definition(tool: ToolSpec) -> dict[str, Any]:
    shown: dict[str, Any] = {"name": tool.name}
    if tool.description:
        shown["description"] = tool.description
    shown["parameters"] = tool.parameters
    return shown


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "const": tool.name},
                       "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }

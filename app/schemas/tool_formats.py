"""Tool calls in a model's own format: which one its chat template speaks, and its grammar.

A chat template that renders a ``tools`` variable was trained with tool calls in its
family's own syntax; it reads the tools better in its own words and answers better in its
own syntax than in the generic format (``tools.py``). Three families, as vLLM's tool
parsers of the same names read them:

* ``hermes`` (Hermes 2 Pro, Qwen 2.5, Qwen 3: the template names ``<tool_call>``): text,
  then each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  calls one per line;
* ``llama3_json`` (Llama 3.1, 3.2: the template asks for ``{"name": function name,
  "parameters": ...}``): the answer is text, or calls ``{"name": ..., "parameters":
  {...}}`` joined by ``"; "``;
* ``mistral`` (Mistral 7B v0.3, Mistral Nemo: the template names ``[TOOL_CALLS]``): the
  answer is text, or ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

``template_tool_format`` tells them from the template's text (``Engine.
chat_template_uses``); any other template, one that names no ``tools``, keeps the generic
format, byte for byte as before. A request speaks the model's format (``request_format``)
unless it asks for an answer that is a JSON document (``response_format`` with ``auto``
tools), which only the generic format can tell from a call.

With a native format the tools go to the template (``template_tools``: OpenAI's function
shape, which these templates take), the system turn gets no generic text, and the answer
is constrained by a Lark grammar (``format_constraint``): the calls in the format's
framing, each call's JSON a ``{"name": <const>, <arguments key>: <its parameters>}`` of a
callable tool (only the named one with a named ``tool_choice``), one call only where
``parallel`` is off; with ``auto`` text may come instead (Hermes: before the calls). The
wire reads it back with ``app.wire``'s format scanner. Where a family's marker is a
special token of the model's tokenizer (Mistral's ``[TOOL_CALLS]``, in some), the
grammar asks for its text, which the detokenizer keeps (it drops special tokens).

Every body with tools (chat, Messages, Responses) speaks them through one mixin,
``SpeaksToolFormats``: told the model's template once (``speak_tools_of``), it gives the
request's ``tool_use`` in the format it is answered in, that format's name for the
encoders, the template's tools and the writer of past calls.

Pure: JSON in, text out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, PrivateAttr

from engine import Constraint, ConstraintKind, bounded_schema

from .tools import (
    CallsText,
    ToolSpec,
    ToolUse,
    calls_text,
    output_constraint,
    system_text,
    with_system_text,
)

GENERIC = "generic"
HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"

# A call's JSON on one line, as the families' own examples write it (llguidance's
# per-schema options: ``docs/structured-output.md``).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Framing:
    """How a family writes its calls around each call's JSON object.

    Args:
        arguments_key: the key of a call's arguments.
        prefix: before the first call (a marker), and ``suffix`` after the last.
        call_open: before each call's JSON, and ``call_close`` after it.
        separator: between two calls.
        text_before: text may come before the calls (else text or calls, not both).
        text_rules: the Lark rules of ``text``, what an answer's text may be: never
            the start of a call (Hermes: pieces without ``<``, or a ``<`` alone, so
            that the lexer ends a piece where ``<tool_call>`` may begin; once the
            text has ``<t``, the call has begun).
    """

    arguments_key: str
    prefix: str
    suffix: str
    call_open: str
    call_close: str
    separator: str
    text_before: bool
    text_rules: tuple[str, ...]


FRAMINGS: dict[str, Framing] = {
    HERMES: Framing("arguments", "", "", "<tool_call>\n", "\n</tool_call>", "\n",
                    text_before=True,
                    text_rules=("text: TEXT_PIECE+", r'TEXT_PIECE: /[^<]+/ | "<"')),
    LLAMA3_JSON: Framing("parameters", "", "", "", "", "; ",
                         text_before=False, text_rules=(r"text: /[^{\s](.|\n)*/",)),
    MISTRAL: Framing("arguments", "[TOOL_CALLS] [", "]", "", "", ", ",
                     text_before=False, text_rules=(r"text: /[^\[\s](.|\n)*/",)),
}

# What a template names when it speaks a family's format (its own text, as the
# families' templates have it), tried in this order once it names ``tools``.
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (HERMES, ("<tool_call>",)),
    (MISTRAL, ("[TOOL_CALLS]",)),
    (LLAMA3_JSON, ('"parameters": dictionary', "<|python_tag|>")),
)


class TemplateReader(Protocol):
    """What tells a chat template's tool format: the serving engine."""

    def chat_template_uses(self, name: str) -> bool: ...


def template_tool_format(model: TemplateReader | None) -> str:
    """The tool format of ``model``'s chat template (None: no model yet): a family's
    where the template renders ``tools`` and names its marker, else ``generic``."""
    if model is None or not model.chat_template_uses("tools"):
        return GENERIC
    for name, markers in _MARKERS:
        if any(model.chat_template_uses(marker) for marker in markers):
            return name
    return GENERIC


class SpeaksToolFormats(BaseModel):
    """A request body whose tools are answered in the model's own format where its chat
    template has one (the module docstring), else in the generic one. A subclass says
    what its request asks of its tools (``asked_tool_use``, in its API's words) and the
    form of an answer that calls none (``format_constraint``, set by the field
    ``FORMAT_PARAM``); the route tells it the model (``speak_tools_of``) before it
    renders the prompt. Tools, when the answer may call them, win: the constraint is
    their format's, and a constraint that does not compile is the tools' fault."""

    # The field that sets the answer's form without tools (``response_format``,
    # ``output_config.format``, ``text.format``): what a refusal of its schema names.
    FORMAT_PARAM: ClassVar[str]

    _model_tool_format: str = PrivateAttr(GENERIC)  # the template's (``speak_tools_of``)

    def asked_tool_use(self) -> ToolUse | None:
        """What the request asks of its tools, in the generic format (None: no tools, or
        a choice of none)."""
        raise NotImplementedError

    if TYPE_CHECKING:
        # Declared, not defined: a body whose format lives in another base (the chat
        # body's ``OpenAIBody``, after this mixin in its bases) keeps that one.
        def format_constraint(self) -> Constraint | None:
            """The engine's constraint on an answer without tools (``FORMAT_PARAM``'s),
            or None for free text."""

    def constraint(self) -> Constraint | None:
        """The engine's constraint on the answer: its tool format's (with tools), else
        ``format_constraint``'s."""
        use = self.tool_use()
        return self.format_constraint() if use is None else answer_constraint(use)

    @property
    def constraint_param(self) -> str:
        """The field to name when the constraint does not compile."""
        return "tools" if self.tool_use() is not None else self.FORMAT_PARAM

    def speak_tools_of(self, model: TemplateReader | None) -> None:
        """Answer with tools in the format of ``model``'s chat template (None: no model
        yet), where it has one of its own, else the generic one. Call it before the
        prompt is rendered (``template_tools``, past calls) and the request is made."""
        self._model_tool_format = template_tool_format(model)

    def tool_use(self) -> ToolUse | None:
        """What the request asks of its tools, in the format it is answered in."""
        return request_format(self._model_tool_format, self.asked_tool_use())

    def tool_format(self) -> str | None:
        """The format of the answer's tool calls (the encoders' ``tools``), or None."""
        use = self.tool_use()
        return None if use is None else use.format

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, where it renders its own; else None."""
        return template_tools(self.tool_use())

    def past_calls_writer(self) -> CallsText:
        """How the conversation's past calls are written (``calls_writer``)."""
        return calls_writer(self.tool_use(), self._model_tool_format)


def request_format(model_format: str, use: ToolUse | None) -> ToolUse | None:
    """``use`` in the model's format, where the request can be answered in it."""
    if use is None or model_format not in FRAMINGS:
        return use
    if use.response_schema is not None and not use.required:
        return use  # text must be a JSON document: only the generic format tells it apart
    return replace(use, format=model_format)


def template_tools(use: ToolUse | None) -> list[dict[str, Any]] | None:
    """The tools for a template that renders its own (OpenAI's function shape), or None
    (the generic format: they are in the system turn's text)."""
    if use is None or use.format not in FRAMINGS:
        return None
    return [{"type": "function", "function": _function(t)} for t in use.tools]


def with_tools(turns: list[dict[str, str]], use: ToolUse | None) -> list[dict[str, str]]:
    """The turns as the template takes them: the generic format's text in the system
    turn; nothing added for a native format (its tools go to the template)."""
    if use is None or use.format in FRAMINGS:
        return turns
    return with_system_text(turns, system_text(use))


def calls_writer(use: ToolUse | None, model_format: str) -> CallsText:
    """How past calls are written in the prompt: in the format of the answer (of
    ``use``; with no tools asked for, the model's), so the model reads its calls as it
    writes them."""
    framing = FRAMINGS.get(model_format if use is None else use.format)
    if framing is None:
        return calls_text
    return partial(_framed_calls, framing)


def _framed_calls(framing: Framing, calls: Sequence[tuple[str, Any]], text: str = "") -> str:
    """Past calls, ``(name, arguments)`` each, in ``framing``; ``text`` before them."""
    written = framing.separator.join(
        framing.call_open + json.dumps({"name": name, framing.arguments_key: arguments},
                                       ensure_ascii=False) + framing.call_close
        for name, arguments in calls)
    document = framing.prefix + written + framing.suffix
    return f"{text}\n{document}" if text else document


def answer_constraint(use: ToolUse) -> Constraint:
    """The constraint on an answer of ``use``, in its format."""
    framing = FRAMINGS.get(use.format)
    if framing is None:
        return output_constraint(use)
    return Constraint(ConstraintKind.GRAMMAR, format_grammar(framing, use))


def format_grammar(framing: Framing, use: ToolUse) -> str:
    """The Lark grammar (llguidance's dialect) of an answer of ``use`` in ``framing``."""
    body = json.dumps(_call_schema(framing, use.callable_tools()), ensure_ascii=False,
                      separators=(",", ":"))
    more = "" if (not use.parallel or use.named is not None) else \
        f" ({json.dumps(framing.separator)} call)*"
    rules = [
        "calls: " + _sequence(framing.prefix, f"call{more}", framing.suffix),
        "call: " + _sequence(framing.call_open, f"%json {body}", framing.call_close),
    ]
    if use.required:
        start = "start: calls"
    else:
        rules += framing.text_rules
        start = "start: text | text? calls" if framing.text_before else "start: text | calls"
    return "\n".join([start, *rules]) + "\n"


def _call_schema(framing: Framing, tools: Sequence[ToolSpec]) -> dict[str, Any]:
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "const": t.name},
                             framing.arguments_key: bounded_schema(dict(t.parameters))},
              "required": ["name", framing.arguments_key], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = items[0] if len(items) == 1 else {"anyOf": items}
    return {**schema, "x-guidance": _JSON_OPTIONS}


def _function(tool: ToolSpec) -> dict[str, Any]:
    shown: dict[str, Any] = {"name": tool.name}
    if tool.description:
        shown["description"] = tool.description
    shown["parameters"] = dict(tool.parameters)
    return shown


def _sequence(before: str, rule: str, after: str) -> str:
    """``rule`` between the literals ``before`` and ``after`` (an empty one left out;
    as Lark string literals, whose escapes are JSON's)."""
    parts = [json.dumps(before, ensure_ascii=False) if before else "", rule,
             json.dumps(after, ensure_ascii=False) if after else ""]
    return " ".join(part for part in parts if part)

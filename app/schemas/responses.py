"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), validated by pydantic.

Owns what a client may send and every check that needs no engine; the events and the
response object are ``app.wire.responses_events``'s. Three kinds of field:

* honoured: ``model``, ``input`` (a string, or items: messages whose content is a string
  or ``input_text``/``output_text`` parts, ``function_call`` and ``function_call_output``
  items), ``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``, ``tools``
  (function tools) with ``tool_choice`` and ``parallel_tool_calls``, ``text.format``
  (``text``, ``json_schema``, ``json_object``), ``top_logprobs`` with ``include:
  ["message.output_text.logprobs"]``, ``metadata``, ``store``, ``background``,
  ``previous_response_id``, ``stream``, ``service_tier`` and vLLM's ``priority`` (the
  band: ``app/priority_bands.py``); and streamscope's ``seed`` and ``deadline_ms`` as on
  the chat route;
* not implemented (``UNSUPPORTED``): accepted at the value that asks for nothing
  (``truncation: "disabled"``, ``moderation: null``, ...), refused otherwise with a 400
  whose ``param`` names the field, since ignoring it would change the answer; a built-in
  tool (``web_search``, ``file_search``, ...), a part that is not text (an image, a
  file) and an item of another kind (``reasoning``, ``item_reference``) likewise;
* hints that change no answer (``user``, ``safety_identifier``, ``prompt_cache_key``,
  ``prompt_cache_options``, ``prompt_cache_retention``,
  ``stream_options``): ignored, as on the chat route; ``reasoning`` and
  ``text.verbosity`` as chat's ``reasoning_effort`` and ``verbosity`` (``hints.py``:
  the route refuses ``reasoning.effort`` for a template that reads it). Any other
  field is refused (OpenAI's own answer to an unknown parameter), so a new field is
  never silently dropped.

Defaults follow OpenAI: ``temperature`` and ``top_p`` 1, ``store`` true; for
``max_output_tokens`` the server's ``STREAMSCOPE_DEFAULT_MAX_NEW_TOKENS``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine import (
    MAX_TOP_LOGPROBS,
    Constraint,
    ConstraintKind,
    GenerationRequest,
    SamplingParams,
)

from ..new_tokens import UNTIL_CONTEXT
from ..priority_bands import OpenAITier, Priority, asked_band
from .hints import Reasoning, Verbosity
from .limits import (
    DeadlineMs,
    NewTokens,
    RequestLimits,
    Seed,
    Temperature,
    TopP,
    check_chat_size,
    check_prompt_chars,
    check_schema_bytes,
    check_tools_within_limit,
    limits_of,
    new_tokens_validator,
)
from .responses_items import InputItem, content_parts, template_messages
from .tool_formats import SpeaksToolFormats, with_tools
from .tools import ToolSpec, ToolUse, function_spec, json_schema_constraint
from .unsupported import neutral_validator

_HOW = "validate a Responses body with the request limits as its context"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_PAIRS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_ITEMS = 1024  # input items in one request

RESPONSES_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "truncation": ("disabled",),
    "conversation": (),
    "prompt": (),
    "max_tool_calls": (),
    "context_management": (),
    "moderation": (),  # a safety check asked for is refused, never silently skipped
}

_FROZEN = ConfigDict(extra="ignore", strict=True, frozen=True)


class FunctionTool(BaseModel):
    """A function the model may call (``type: "function"``; built-in tools are refused)."""

    model_config = _FROZEN

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # strict or not, the arguments are constrained

    def spec(self) -> ToolSpec:
        return function_spec(self.name, self.description, self.parameters)


class NamedFunction(BaseModel):
    model_config = _FROZEN

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: plain text, a JSON document of a schema, or any JSON object."""

    model_config = _FROZEN

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise PydanticCustomError("schema_required",
                                      "a json_schema format needs its name and schema", {})
        return self


class TextConfig(BaseModel):
    model_config = _FROZEN

    format: TextFormat | None = None
    verbosity: Verbosity | None = None  # ignored: hints.py


class ResponsesBody(SpeaksToolFormats):
    """``POST /v1/responses`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = RESPONSES_UNSUPPORTED
    FORMAT_PARAM: ClassVar[str] = "text.format"

    model: str | None = None
    input: Annotated[list[InputItem], Field(max_length=MAX_ITEMS)] | None = None
    instructions: str | None = None
    max_output_tokens: NewTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[Literal["message.output_text.logprobs"]] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    seed: Seed | None = None  # streamscope, as on the chat route
    deadline_ms: DeadlineMs | None = None  # streamscope: a TTFT deadline
    # The band (app/priority_bands.py): vLLM's priority, else OpenAI's service_tier.
    priority: Priority | None = None
    service_tier: OpenAITier | None = None
    # Hints that change no answer: ignored.
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    stream_options: Any = None
    prompt_cache_options: Any = None  # the prefix cache keeps what room allows
    prompt_cache_retention: Any = None
    # Ignored where the template has no use for it (hints.py; the route checks).
    reasoning: Reasoning | None = None
    # Not implemented: see RESPONSES_UNSUPPORTED.
    truncation: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None

    _neutral = neutral_validator(list(RESPONSES_UNSUPPORTED))

    @field_validator("input", mode="before")
    @classmethod
    def _string_is_one_message(cls, value: object) -> object:
        """A string is one user message."""
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        return value

    _within_limit = new_tokens_validator(_HOW, "max_output_tokens")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (
            len(value) > MAX_METADATA_PAIRS
            or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                   for k, v in value.items())
        ):
            raise PydanticCustomError(
                "metadata", "at most {pairs} pairs, keys of at most {key} characters and "
                "values of at most {value}", {"pairs": MAX_METADATA_PAIRS,
                                              "key": MAX_METADATA_KEY,
                                              "value": MAX_METADATA_VALUE})
        return value

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> ResponsesBody:
        if self.input is None and self.previous_response_id is None:
            raise PydanticCustomError("input_required", "input is required", {})
        if self.background and self.store is False:
            raise PydanticCustomError("background_needs_store",
                                      "background responses need store: true", {})
        limits = limits_of(info, _HOW)
        if self.tools:
            check_tools_within_limit([t.spec().parameters for t in self.tools], limits,
                                     "the tools' parameters")
        schema = self._format_schema()
        if schema is not None:
            check_schema_bytes(schema, limits, "text.format's schema")
        names = {t.name for t in self.tools or ()}
        if len(names) != len(self.tools or ()):
            raise PydanticCustomError("tools", "two tools have the same name", {})
        choice = self.tool_choice
        if isinstance(choice, NamedFunction) and choice.name not in names:
            # pydantic fills {name} only (no conversion): the quotes are the template's
            raise PydanticCustomError("tool_choice", "tool_choice names the function "
                                      "'{name}', which is not in tools", {"name": choice.name})
        if choice == "required" and not names:
            raise PydanticCustomError("tool_choice", "tool_choice required needs tools", {})
        self.check_conversation(self.input_items(), limits)
        return self

    def check_conversation(self, context: list[dict[str, Any]], limits: RequestLimits) -> None:
        """The chat routes' caps on what the template would render: the messages (the
        ``instructions`` turn counts as one), their text parts and their characters, over
        the whole conversation (``context``: a previous response's stored turns, then
        this input). The body's validation checks its own input; the route checks again
        with the stored turns, before rendering (each costs the template's work on the
        one tokenizer slot).

        Raises: PydanticCustomError over_limit.
        """
        turns = template_messages(context)
        system = bool(self.instructions)
        check_chat_size(len(turns) + system, content_parts(context) + system, limits)
        check_prompt_chars(len(self.instructions or "") + sum(len(m["content"]) for m in turns),
                           limits)

    def _format_schema(self) -> dict[str, Any] | None:
        """The answer's schema (``text.format``): None for text, any object for
        ``json_object``."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        return fmt.schema_ if fmt.type == "json_schema" else {"type": "object"}

    def asked_tool_use(self) -> ToolUse | None:
        """What the request asks of its tools (None: none, or ``tool_choice: none``);
        ``tool_use`` answers it in the model's format (``SpeaksToolFormats``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        choice = self.tool_choice
        named = choice.name if isinstance(choice, NamedFunction) else None
        return ToolUse(tools=tuple(t.spec() for t in self.tools),
                       required=choice == "required" or named is not None, named=named,
                       parallel=self.parallel_tool_calls is not False,
                       response_schema=self._format_schema())

    def format_constraint(self) -> Constraint | None:
        """``text.format``'s constraint: any JSON object, a schema's document, or None."""
        if self.format_type == "json_object":
            return Constraint(ConstraintKind.JSON_OBJECT)
        schema = self._format_schema()
        return None if schema is None else json_schema_constraint(schema)

    def prompt_turns(self, context: list[dict[str, Any]]) -> list[dict[str, str]]:
        """What the chat template renders: ``instructions`` as the system turn, then the
        conversation's items (``template_messages``, past calls in the answer's format),
        and the tools (if the answer may call them) in the system turn, in the generic
        format's words (a template with its own takes them as ``template_tools``)."""
        turns = [{"role": "system", "content": self.instructions}] if self.instructions else []
        turns += template_messages(context, self.past_calls_writer())
        return with_tools(turns, self.tool_use())

    # -- what the request asks for ---------------------------------------------------

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items (a string is one user message), as JSON objects: what
        ``input_items`` lists and a later turn continues from."""
        return [item.model_dump(mode="json", exclude_none=True, by_alias=True)
                for item in self.input or ()]

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    @property
    def format_type(self) -> str:
        fmt = self.text.format if self.text is not None else None
        return "text" if fmt is None else fmt.type

    def new_tokens(self) -> int:
        """``max_output_tokens``, or ``UNTIL_CONTEXT``: what the context leaves."""
        return self.max_output_tokens or UNTIL_CONTEXT

    @property
    def asked_band(self) -> int | None:
        """The band it asks for (``priority_bands.asked_band``); None: neither field."""
        return asked_band(self.priority, self.service_tier)

    def generation_request(
        self, prompt: str | None = None, prompt_ids: tuple[int, ...] | None = None, *,
        ttft_deadline: float | None = None,
    ) -> GenerationRequest:
        """The engine's request for the rendered conversation ``prompt`` and its ids, due
        its first token by ``ttft_deadline`` (see ``serving.ttft_deadline``).

        Raises: ValueError without ``prompt``: a conversation has no prompt of its own."""
        if prompt is None:
            raise ValueError("a conversation has no prompt of its own: render it")
        return GenerationRequest(
            request_id=uuid.uuid4().hex, prompt=prompt, max_new_tokens=self.new_tokens(),
            sampling=SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                logprobs=self.wants_logprobs, top_logprobs=self.top_logprobs or 0),
            prompt_token_ids=prompt_ids, ttft_deadline=ttft_deadline,
            constraint=self.constraint())

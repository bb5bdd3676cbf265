"""The request bodies of the Anthropic Messages routes, validated by pydantic.

Owns what a client may send to ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens`` and every check that needs no engine; the answers' shapes
are in ``app.wire``. As Anthropic's API does, a field this server does not know is
refused (400, naming it), since the official SDK sends only the fields it was given.
Four kinds of field:

* honoured: ``model`` (required, as the API requires), ``messages`` (``user`` and
  ``assistant`` turns, each a string or content blocks: text, and the tool blocks of
  ``anthropic_blocks.py``), ``system`` (a string or text blocks), ``max_tokens``
  (required), ``stop_sequences``, ``temperature`` (default 1.0, the API's), ``top_p``,
  ``top_k`` (the newest SDK sends these three through ``extra_body``), ``stream``,
  ``tools`` and ``tool_choice`` (which constrain the answer: ``tools.py``),
  ``service_tier`` and vLLM's ``priority`` (the band: ``app/priority_bands.py``);
  ``output_config.format`` (structured output, its ``effort`` refused:
  ``anthropic_output.py``);
* accepted, changing nothing in the answer: ``metadata`` (``user_id``),
  ``cache_control`` (a prompt-caching hint, also on text blocks);
* unsupported (``ANTHROPIC_UNSUPPORTED``): accepted at a value that asks for nothing
  (``thinking: {"type": "disabled"}``, null), refused otherwise; a content block this
  server does not serve (an image, a document, a thinking block) is refused naming its
  message, block and type;
* refused: a conversation whose last turn is the assistant's (a "prefill": the
  answer would continue that turn, which the chat template cannot render).

The ranges and the server's limits are the other bodies' (``limits.py``); a
message's and the system prompt's text blocks are joined with newlines, as the
OpenAI chat route joins text parts.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine import Constraint, GenerationRequest, SamplingParams

from ..priority_bands import AnthropicTier, Priority, asked_band
from .anthropic_blocks import (
    SERVED_BLOCKS,
    AnthropicTool,
    ContentBlock,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    anthropic_tool_use,
    check_tools,
    turn_text,
)
from .anthropic_output import OutputConfig
from .content_text import content_text
from .limits import (
    CacheSalt,
    NewTokens,
    StopStrings,
    Temperature,
    TopP,
    check_chat_size,
    check_prompt_chars,
    check_schema_bytes,
    limits_of,
    new_tokens_validator,
    salt_bytes,
)
from .tool_fields import tool_field_validators
from .tool_formats import SpeaksToolFormats, with_tools
from .tools import CallsText, ToolUse, calls_text, json_schema_constraint
from .unsupported import neutral_validator

ANTHROPIC_DEFAULT_TEMPERATURE = 1.0  # the API's default

_HOW = "validate an Anthropic body with the request limits as its context"

# Fields of the Messages API this server does not implement, with the values that ask
# for nothing (null is always neutral).
PROMPT_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "thinking": ({"type": "disabled"},),
    "mcp_servers": ([],),
    "context_management": (),
}
ANTHROPIC_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    **PROMPT_UNSUPPORTED,
    "container": (),
    "inference_geo": (),
    "diagnostics": (),
    "speed": ("standard",),
}


def _text_blocks(value: object, served: frozenset[str] = frozenset({"text"})) -> object:
    """A string as one text block; a list refused at its first block of a type not
    ``served`` (named: ``block 1 is of type 'image'``). Anything else is left to the
    field's type."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if isinstance(value, list):
        for index, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in served:
                raise PydanticCustomError(
                    "unsupported",
                    "block {index} is of type '{kind}'; this server serves {served} "
                    "blocks only (no images, documents or thinking)",
                    {"index": index, "kind": kind[:40], "served": ", ".join(sorted(served))},
                )
    return value


class InputMessage(BaseModel):
    """One turn: its role and its content (a string, or content blocks: text, and an
    assistant's ``tool_use`` or a user's ``tool_result``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, value: object) -> object:
        return _text_blocks(value, SERVED_BLOCKS)

    @model_validator(mode="after")
    def _tool_blocks_in_their_turn(self) -> Self:
        wrong = ToolResultBlock if self.role == "assistant" else ToolUseBlock
        for index, block in enumerate(self.content):
            if isinstance(block, wrong):
                raise PydanticCustomError(
                    "unsupported", "block {index}: a {kind} block belongs in the other "
                    "role's turn", {"index": index, "kind": block.type})
        return self

    def as_template_input(self, names: dict[str, str],
                          write_calls: CallsText = calls_text) -> dict[str, str]:
        return {"role": self.role, "content": turn_text(self.content, names, write_calls)}


class AnthropicPrompt(SpeaksToolFormats):
    """What both routes share: the model, the conversation, the unsupported fields."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = PROMPT_UNSUPPORTED
    FORMAT_PARAM: ClassVar[str] = "output_config.format"

    model: Annotated[str, Field(min_length=1)]
    messages: list[InputMessage] = Field(min_length=1)
    system: list[TextBlock] | None = None
    cache_control: dict[str, Any] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None  # its format: the answer's schema
    # Unsupported: see UNSUPPORTED; checked by _neutral.
    thinking: Any = None
    mcp_servers: Any = None
    context_management: Any = None

    _neutral = neutral_validator(list(PROMPT_UNSUPPORTED))

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, value: object) -> object:
        return _text_blocks(value)

    @field_validator("messages")
    @classmethod
    def _ends_with_the_user(cls, value: list[InputMessage]) -> list[InputMessage]:
        if value[-1].role != "user":
            raise PydanticCustomError(
                "unsupported",
                "the last message must be the user's: this server does not continue a "
                "final assistant turn (prefill)",
            )
        return value

    # The tools within the limits, named once; tool_choice among them (tool_fields.py).
    _tools_checked, _choice_checked = tool_field_validators(
        _HOW, lambda tool: tool.input_schema, "the tools' input schemas", check_tools)

    @model_validator(mode="after")
    def _within_limit(self, info: ValidationInfo) -> Self:
        limits = limits_of(info, _HOW)
        system = self.system or []
        check_chat_size(len(self.messages) + bool(self.system),
                        sum(len(m.content) for m in self.messages) + len(system), limits)
        check_prompt_chars(sum(len(m["content"]) for m in self.template_input()), limits)
        if (schema := self.answer_schema) is not None:
            check_schema_bytes(schema, limits, "output_config.format's schema")
        return self

    @property
    def answer_schema(self) -> dict[str, Any] | None:
        """The schema the answer must be a document of (``output_config.format``), or
        None for free text."""
        return None if self.output_config is None else self.output_config.answer_schema

    def asked_tool_use(self) -> ToolUse | None:
        """What the request asks of its tools (None: no tools, or ``none``);
        ``tool_use`` answers it in the model's format (``SpeaksToolFormats``)."""
        return anthropic_tool_use(self.tools, self.tool_choice, self.answer_schema)

    def format_constraint(self) -> Constraint | None:
        """``output_config.format``'s schema as the engine's constraint, or None."""
        schema = self.answer_schema
        return None if schema is None else json_schema_constraint(schema)

    def template_input(self) -> list[dict[str, str]]:
        """The conversation as a chat template takes it: the system prompt (if any) as
        the first message, with the tools (if the answer may call them, in the generic
        format: a template with its own takes them as ``template_tools``), then the
        turns (tool blocks as text, past calls in the answer's format)."""
        names: dict[str, str] = {}
        write_calls = self.past_calls_writer()
        turns = [m.as_template_input(names, write_calls) for m in self.messages]
        if self.system is not None:
            turns = [{"role": "system", "content": content_text(self.system)}, *turns]
        return with_tools(turns, self.tool_use())


class CountTokensBody(AnthropicPrompt):
    """``POST /v1/messages/count_tokens``: the prompt alone, and ``speed``, which the
    SDK's ``count_tokens`` sends too (accepted at ``"standard"``, as on the Messages
    route, rather than refused as an unknown field)."""

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        **PROMPT_UNSUPPORTED, "speed": ANTHROPIC_UNSUPPORTED["speed"]}

    speed: Any = None

    _speed_neutral = neutral_validator(["speed"])


class MessagesBody(AnthropicPrompt):
    """``POST /v1/messages``: the prompt, and how to answer it."""

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = ANTHROPIC_UNSUPPORTED

    max_tokens: NewTokens
    stop_sequences: StopStrings | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    metadata: dict[str, Any] | None = None  # user_id: changes nothing in the answer
    # The band (app/priority_bands.py): vLLM's priority, else Anthropic's service_tier.
    service_tier: AnthropicTier | None = None
    priority: Priority | None = None
    container: Any = None
    inference_geo: Any = None
    diagnostics: Any = None
    speed: Any = None
    cache_salt: CacheSalt | None = None  # as vLLM's: splits the key's prefix cache

    _neutral = neutral_validator(list(ANTHROPIC_UNSUPPORTED))

    _tokens_within_limit = new_tokens_validator(_HOW, "max_tokens")

    @property
    def is_streaming(self) -> bool:
        return bool(self.stream)

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    @property
    def asked_band(self) -> int | None:
        """The band it asks for (``priority_bands.asked_band``); None: neither field."""
        return asked_band(self.priority, self.service_tier)

    def generation_request(
        self, prompt: str | None = None, prompt_ids: tuple[int, ...] | None = None, *,
        ttft_deadline: float | None = None,
    ) -> GenerationRequest:
        """The engine's request for the rendered ``prompt`` and its ids, due its first
        token by ``ttft_deadline`` (see ``serving.ttft_deadline``).

        Raises: ValueError without ``prompt``: a conversation has no prompt of its own."""
        if prompt is None:
            raise ValueError("a conversation has no prompt of its own: render it")
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt=prompt,
            max_new_tokens=self.max_tokens,
            stop=self.stops,
            sampling=SamplingParams(
                temperature=(ANTHROPIC_DEFAULT_TEMPERATURE if self.temperature is None
                             else self.temperature),
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
            ),
            prompt_token_ids=prompt_ids,
            ttft_deadline=ttft_deadline,
            cache_namespace=salt_bytes(self.cache_salt),
            constraint=self.constraint(),
        )

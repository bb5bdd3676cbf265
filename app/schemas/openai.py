"""The request bodies of the OpenAI-compatible routes, validated by pydantic.

Owns what a client may send to ``/v1/completions`` and ``/v1/chat/completions`` and
every check that needs no engine; the wire shapes of the answers are in ``app.wire``.
Three kinds of field:

* honoured: ``model``, ``max_tokens`` (chat also ``max_completion_tokens``, which wins),
  ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream``,
  ``stream_options.include_usage``, and the extensions vLLM accepts ``ignore_eos`` and
  ``top_k`` (``-1`` or ``0``: no cut), ``priority`` and ``service_tier`` (the band:
  ``app/priority_bands.py``), ``frequency_penalty``, ``presence_penalty``,
  ``logit_bias`` and vLLM's ``repetition_penalty`` (``penalties.py``), ``n`` (1 to
  ``MAX_CHOICES``: several choices, ``app/routes/choices.py``), and streamscope's
  ``deadline_ms`` (a TTFT deadline,
  as on ``/v1/stream``); chat also ``messages``, ``add_generation_prompt``, ``logprobs``
  (a boolean), ``top_logprobs`` (0 to 20, with ``logprobs``), ``reasoning_effort``
  (ignored: refused by the route for a template that would use it) and ``verbosity``
  (ignored: ``hints.py``, as the Responses route takes both); completions also
  ``logprobs`` (0 to 5: the chosen token's and that many likeliest tokens'); both
  ``response_format``, and chat ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
  tool turns (``openai_tools.py``, ``openai_messages.py``), which constrain the answer
  (``tools.py``);
* unsupported (``UNSUPPORTED``, in ``unsupported.py``): accepted at their neutral value
  (``best_of: 1``, ``echo: false``, null, ...), refused otherwise
  with a 400 whose ``param`` names the field. ``min_tokens`` is one: the engine has no
  minimum length (it would need the end-of-sequence token masked until then);
  ``moderation`` is another: a safety check asked for is refused (400) rather than
  silently skipped, as on the Responses route;
* any other field is ignored, as OpenAI's clients send many (``user``, ``metadata``,
  ``prompt_cache_options``: the prefix cache keeps what room allows).

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1; ``max_tokens`` 16 for
completions, and for chat (where OpenAI's default is "up to the context") the server's
``STREAMSCOPE_DEFAULT_MAX_NEW_TOKENS``. A JSON ``null`` means the default. The ranges
and the server's limits are the native body's (``limits.py``).
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine import MAX_TOP_LOGPROBS, Constraint, GenerationRequest, SamplingParams

from ..new_tokens import UNTIL_CONTEXT
from ..priority_bands import OpenAITier, Priority, asked_band
from .hints import ReasoningEffort, Verbosity
from .limits import (
    CacheSalt,
    DeadlineMs,
    NewTokens,
    Prompt,
    Seed,
    StopString,
    StopStrings,
    Temperature,
    TopP,
    check_chat_size,
    check_prompt_chars,
    check_schema_bytes,
    check_top_logprobs,
    limits_of,
    new_tokens_validator,
    salt_bytes,
)
from .openai_messages import ChatMessage, template_input
from .openai_tools import (
    FunctionTool,
    ResponseFormat,
    ToolChoice,
    check_tools,
    openai_tool_use,
)
from .penalties import LogitBias, Penalty, RepetitionPenalty, bias_pairs
from .tool_fields import tool_field_validators
from .tool_formats import SpeaksToolFormats, with_tools
from .tools import ToolUse
from .unsupported import (
    CHAT_UNSUPPORTED,
    COMMON_UNSUPPORTED,
    COMPLETIONS_UNSUPPORTED,
    neutral_validator,
)

OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for completions
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs
# The most choices (``n``) one request may ask for: each is a sequence of its own, in the
# batch and the cache (vLLM bounds it by its batch; 8 keeps one request from filling ours).
MAX_CHOICES = 8

_HOW = "validate an OpenAI body with the request limits as its context"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    include_usage: bool | None = None


class OpenAIBody(BaseModel):
    """What both routes share: the model, sampling, stopping, streaming, extensions."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)
    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = COMMON_UNSUPPORTED

    model: str | None = None
    max_tokens: NewTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: StopString | StopStrings | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM
    top_k: int | None = Field(default=None, ge=-1)  # vLLM: -1 (and 0) for no cut
    # streamscope: a TTFT deadline, as on /v1/stream (429 deadline_unmeetable if missed)
    deadline_ms: DeadlineMs | None = None
    cache_salt: CacheSalt | None = None  # vLLM: splits the key's prefix cache
    # The answer's form (openai_tools.py): JSON, or a document of a schema.
    response_format: ResponseFormat | None = None
    # Unsupported: see UNSUPPORTED; checked by the subclasses' _neutral.
    # The logits' changes (penalties.py, engine.penalties): OpenAI's, and vLLM's
    # repetition_penalty.
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM
    logit_bias: LogitBias | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # choices: routes/choices.py
    # The band (app/priority_bands.py): vLLM's priority, else OpenAI's service_tier.
    priority: Priority | None = None
    service_tier: OpenAITier | None = None
    min_tokens: Any = None
    best_of: Any = None

    _within_limit = new_tokens_validator(_HOW, "max_tokens")

    @field_validator("response_format")
    @classmethod
    def _format_within_limit(cls, value: ResponseFormat | None, info: ValidationInfo
                             ) -> ResponseFormat | None:
        schema = None if value is None else value.response_schema()
        if schema is not None:
            check_schema_bytes(schema, limits_of(info, _HOW), "the response_format's schema")
        return value

    @property
    def is_streaming(self) -> bool:
        return bool(self.stream)

    @property
    def asked_band(self) -> int | None:
        """The band it asks for (``priority_bands.asked_band``); None: neither field."""
        return asked_band(self.priority, self.service_tier)

    FORMAT_PARAM: ClassVar[str] = "response_format"

    @property
    def constraint_param(self) -> str:
        """The field to name when the constraint does not compile."""
        return self.FORMAT_PARAM

    def format_constraint(self) -> Constraint | None:
        """``response_format``'s constraint on the answer, or None for free text."""
        return None if self.response_format is None else self.response_format.constraint()

    def constraint(self) -> Constraint | None:
        """The engine's constraint on the answer (a chat body's tools win over it:
        ``SpeaksToolFormats``)."""
        return self.format_constraint()

    @property
    def choices(self) -> int:
        """How many choices (``n``), each a stream of its own."""
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def new_tokens(self) -> int:
        return self.max_tokens or OPENAI_DEFAULT_MAX_TOKENS

    def logprob_request(self) -> tuple[bool, int]:
        """(whether to report log-probabilities, how many likeliest tokens)."""
        return False, 0

    def own_prompt(self) -> str:
        """The body's own prompt (a completion's); a chat body has none: it is rendered.

        Raises: ValueError for a body that has none."""
        raise ValueError(f"{type(self).__name__} has no prompt of its own: render it")

    def generation_request(
        self, prompt: str | None = None, prompt_ids: tuple[int, ...] | None = None, *,
        ttft_deadline: float | None = None,
    ) -> GenerationRequest:
        """The engine's request for ``prompt`` (None: the body's own, a completion's) and
        its ids, if already encoded, due its first token by ``ttft_deadline`` (see
        ``serving.ttft_deadline``)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, top_logprobs = self.logprob_request()
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt=self.own_prompt() if prompt is None else prompt,
            max_new_tokens=self.new_tokens(),
            stop=tuple(stops),
            sampling=SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0),
                seed=self.seed,
                ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if self.repetition_penalty is None
                                    else self.repetition_penalty),
                logit_bias=bias_pairs(self.logit_bias),
            ),
            prompt_token_ids=prompt_ids,
            ttft_deadline=ttft_deadline,
            cache_namespace=salt_bytes(self.cache_salt),
            constraint=self.constraint(),
        )


class CompletionsBody(OpenAIBody):
    """``POST /v1/completions``: a prompt string and the shared fields."""

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = COMPLETIONS_UNSUPPORTED

    prompt: Prompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: Any = None
    suffix: Any = None

    _neutral = neutral_validator(list(COMPLETIONS_UNSUPPORTED))

    @field_validator("prompt")
    @classmethod
    def _prompt_within_limit(cls, value: str, info: ValidationInfo) -> str:
        check_prompt_chars(len(value), limits_of(info, _HOW))
        return value

    def logprob_request(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def own_prompt(self) -> str:
        return self.prompt


class ChatBody(SpeaksToolFormats, OpenAIBody):
    """``POST /v1/chat/completions``: messages, rendered by the model's chat template.
    ``SpeaksToolFormats`` comes first: its ``constraint`` (tools win) and
    ``constraint_param`` are the chat body's, over ``OpenAIBody``'s format alone."""

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = CHAT_UNSUPPORTED

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # vLLM; false to continue the last message
    max_completion_tokens: NewTokens | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    # Accepted where the model's chat template has no use for it (it changes nothing
    # there, as vLLM has it); the route refuses it for a template that reads it.
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None  # ignored: a hint a small model cannot honour
    web_search_options: Any = None
    store: Any = None
    moderation: Any = None  # refused unless null: a safety check is never skipped

    _neutral = neutral_validator(list(CHAT_UNSUPPORTED))

    _completion_within_limit = new_tokens_validator(_HOW, "max_completion_tokens")

    @field_validator("messages")
    @classmethod
    def _messages_within_limit(
        cls, value: list[ChatMessage], info: ValidationInfo
    ) -> list[ChatMessage]:
        limits = limits_of(info, _HOW)
        check_chat_size(len(value), sum(m.parts for m in value), limits)
        text = sum(len(m["content"]) for m in template_input(value))
        check_prompt_chars(text, limits)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        return check_top_logprobs(value, info.data.get("logprobs"))

    # The tools within the limits, named once; tool_choice among them (tool_fields.py).
    _tools_checked, _choice_checked = tool_field_validators(
        _HOW, lambda tool: tool.function.spec().parameters, "the tools' parameters",
        check_tools)

    def asked_tool_use(self) -> ToolUse | None:
        """What the request asks of its tools (None: no tools, or ``tool_choice: none``);
        ``tool_use`` answers it in the model's format (``SpeaksToolFormats``)."""
        return openai_tool_use(self.tools, self.tool_choice, self.parallel_tool_calls,
                               self.response_format)

    def logprob_request(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0

    def template_input(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: tool turns as text, and the
        tools (if the answer may call them) in the system turn, in the generic format
        (a template with its own takes them as ``template_tools``)."""
        return with_tools(template_input(self.messages, self.past_calls_writer()),
                          self.tool_use())

    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or UNTIL_CONTEXT

    def new_tokens_field(self) -> str:
        """The field a refusal of the new tokens names (``max_completion_tokens`` wins)."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

"""The request bodies every route accepts, validated by pydantic before the engine.

``limits`` holds what the bodies share (the ranges, the server's limits and their
messages), ``native`` the body of ``/v1/stream`` and ``/v1/generate``, ``openai`` those
of ``/v1/completions`` and ``/v1/chat/completions`` (with ``unsupported``, the OpenAI
fields refused unless neutral), ``anthropic`` those of ``/v1/messages`` and
``/v1/messages/count_tokens``, ``responses`` that of ``/v1/responses``. Other modules
import from this root only.
"""

from __future__ import annotations

from .anthropic import CountTokensBody as CountTokensBody
from .anthropic import MessagesBody as MessagesBody
from .limits import MAX_DEADLINE_MS as MAX_DEADLINE_MS
from .limits import MAX_STOP_CHARS as MAX_STOP_CHARS
from .limits import MAX_STOP_STRINGS as MAX_STOP_STRINGS
from .limits import RequestLimits as RequestLimits
from .native import GenerateBody as GenerateBody
from .native import parse_generate_body as parse_generate_body
from .openai import OPENAI_DEFAULT_MAX_TOKENS as OPENAI_DEFAULT_MAX_TOKENS
from .openai import ChatBody as ChatBody
from .openai import ChatMessage as ChatMessage
from .openai import CompletionsBody as CompletionsBody
from .openai import OpenAIBody as OpenAIBody
from .responses import ResponsesBody as ResponsesBody

__all__ = [
    "MAX_DEADLINE_MS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "OPENAI_DEFAULT_MAX_TOKENS",
    "ChatBody",
    "ChatMessage",
    "CompletionsBody",
    "CountTokensBody",
    "GenerateBody",
    "MessagesBody",
    "OpenAIBody",
    "RequestLimits",
    "ResponsesBody",
    "parse_generate_body",
]

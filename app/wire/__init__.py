"""Sans-IO wire encoders: a stream's items to the bytes of an SSE response.

No Quart, no Trio, no hypercorn: each encoder keeps only what its bytes need, so it is
tested without a server (as ``streams.sse`` is) and the one SSE body of ``app.routes``
drives any of them through the same four calls (``Encoder``). Four encoders:
``NativeEvents`` (``/v1/stream``), ``OpenAIChunks`` (the OpenAI-compatible routes, in a
``ChoiceShape``: ``COMPLETION`` or ``CHAT``), ``AnthropicEvents`` (``/v1/messages``)
``ResumableEvents`` (a resumable stream's events, ids ``<request_id>:<n>``) and
``ResponseEvents`` (``/v1/responses``; made again from a background response's log by
``ReplayedEvents``).
"""

from __future__ import annotations

from .anthropic_events import AnthropicEvents as AnthropicEvents
from .anthropic_events import whole_message as whole_message
from .encoder import KEEPALIVE_COMMENT as KEEPALIVE_COMMENT
from .encoder import Encoder as Encoder
from .native import NativeEvents as NativeEvents
from .native import encode_json_event as encode_json_event
from .native import error_data as error_data
from .native import item_event as item_event
from .native import logprobs_data as logprobs_data
from .native import start_event as start_event
from .native import token_event as token_event
from .native import usage_data as usage_data
from .openai_chunks import DONE as DONE
from .openai_chunks import ChoiceFinish as ChoiceFinish
from .openai_chunks import ErrorEnvelope as ErrorEnvelope
from .openai_chunks import OpenAIChunks as OpenAIChunks
from .openai_chunks import choices_usage as choices_usage
from .openai_shapes import CHAT as CHAT
from .openai_shapes import COMPLETION as COMPLETION
from .openai_shapes import FINISH_REASONS as FINISH_REASONS
from .openai_shapes import ChatShape as ChatShape
from .openai_shapes import ChoiceShape as ChoiceShape
from .openai_shapes import CompletionShape as CompletionShape
from .openai_shapes import usage as usage
from .openai_shapes import whole_answer as whole_answer
from .openai_tools import tool_message as tool_message
from .output_parser import OutputParser as OutputParser
from .output_parser import PlainText as PlainText
from .output_parser import ToolCalls as ToolCalls
from .responses_events import ResponseEvents as ResponseEvents
from .responses_replay import ReplayedEvents as ReplayedEvents
from .responses_replay import replay as replay
from .resumable import RETRY_LINE as RETRY_LINE
from .resumable import RETRY_MS as RETRY_MS
from .resumable import TAKEN_OVER_EVENT as TAKEN_OVER_EVENT
from .resumable import ResumableEvents as ResumableEvents
from .resumable import event_without_id as event_without_id
from .scope_events import ScopeEvents as ScopeEvents
from .scope_events import SharedFrames as SharedFrames

__all__ = [
    "CHAT",
    "COMPLETION",
    "DONE",
    "FINISH_REASONS",
    "KEEPALIVE_COMMENT",
    "RETRY_LINE",
    "RETRY_MS",
    "TAKEN_OVER_EVENT",
    "AnthropicEvents",
    "ChatShape",
    "ChoiceFinish",
    "ChoiceShape",
    "CompletionShape",
    "Encoder",
    "ErrorEnvelope",
    "NativeEvents",
    "OpenAIChunks",
    "OutputParser",
    "PlainText",
    "ReplayedEvents",
    "ResponseEvents",
    "ResumableEvents",
    "ScopeEvents",
    "SharedFrames",
    "ToolCalls",
    "choices_usage",
    "encode_json_event",
    "error_data",
    "event_without_id",
    "item_event",
    "logprobs_data",
    "replay",
    "start_event",
    "token_event",
    "tool_message",
    "usage",
    "usage_data",
    "whole_answer",
    "whole_message",
]

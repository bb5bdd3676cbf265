"""Streams: the hub that steps the engine, per-request token streams, slow-reader
policies, and the SSE codec.

Knows Trio and the engine's plain data types; never imports torch, transformers,
Quart, hypercorn or ``app``. Other packages import only from this package root.
"""

from __future__ import annotations

from .errors import HubError as HubError
from .errors import NotAccepting as NotAccepting
from .errors import WaitingLimitReached as WaitingLimitReached
from .hub import Hub as Hub
from .hub_types import HubSettings as HubSettings
from .hub_types import HubState as HubState
from .hub_types import HubStatistics as HubStatistics
from .hub_types import StepEngine as StepEngine
from .policy import PolicyName as PolicyName
from .sse import ServerSentEvent as ServerSentEvent
from .sse import SSEParser as SSEParser
from .sse import encode_comment as encode_comment
from .sse import encode_event as encode_event
from .stream import ErrorType as ErrorType
from .stream import StreamEnd as StreamEnd
from .stream import StreamError as StreamError
from .stream import StreamItem as StreamItem
from .stream import StreamState as StreamState
from .stream import StreamStatistics as StreamStatistics
from .stream import TokenStream as TokenStream

__all__ = [
    "ErrorType",
    "Hub",
    "HubError",
    "HubSettings",
    "HubState",
    "HubStatistics",
    "NotAccepting",
    "PolicyName",
    "SSEParser",
    "ServerSentEvent",
    "StepEngine",
    "StreamEnd",
    "StreamError",
    "StreamItem",
    "StreamState",
    "StreamStatistics",
    "TokenStream",
    "WaitingLimitReached",
    "encode_comment",
    "encode_event",
]

"""Streams: the hub that steps the engine, per-request token streams, slow-reader
policies, and the SSE codec.

Knows Trio and the engine's plain data types; never imports torch, transformers,
Quart, hypercorn or ``app``. Other packages import only from this package root, and
the resumable streams' names from ``streams.resume``.

The names load lazily (module ``__getattr__``): importing the package, or one of its
Trio-free modules (``streams.sse``, ``streams.policy``), loads no Trio until a name
that needs it is used, so the sans-IO codecs built on them (``app.wire``) stay sans-IO.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .error_type import ErrorType as ErrorType
    from .errors import DeadlineUnmeetable as DeadlineUnmeetable
    from .errors import HubError as HubError
    from .errors import NotAccepting as NotAccepting
    from .errors import WaitingLimitReached as WaitingLimitReached
    from .hub import Hub as Hub
    from .hub_types import HubSettings as HubSettings
    from .hub_types import HubState as HubState
    from .hub_types import HubStatistics as HubStatistics
    from .hub_types import RunStep as RunStep
    from .hub_types import StepEngine as StepEngine
    from .keepalive import Keepalives as Keepalives
    from .policy import PolicyName as PolicyName
    from .scope_feed import ScopeFeed as ScopeFeed
    from .scope_types import ScopeFrame as ScopeFrame
    from .scope_types import ScopeMoment as ScopeMoment
    from .scope_types import ScopePool as ScopePool
    from .scope_types import ScopeRow as ScopeRow
    from .scope_types import ScopeStep as ScopeStep
    from .scope_watcher import ScopeItem as ScopeItem
    from .scope_watcher import ScopeWatcher as ScopeWatcher
    from .sse import ServerSentEvent as ServerSentEvent
    from .sse import SSEParser as SSEParser
    from .sse import encode_comment as encode_comment
    from .sse import encode_event as encode_event
    from .stream import StreamEnd as StreamEnd
    from .stream import StreamError as StreamError
    from .stream import StreamItem as StreamItem
    from .stream import StreamState as StreamState
    from .stream import StreamStatistics as StreamStatistics
    from .stream import TokenStream as TokenStream

_HOMES = {  # the module that defines each exported name
    "DeadlineUnmeetable": "errors",
    "ErrorType": "error_type",
    "Hub": "hub",
    "HubError": "errors",
    "HubSettings": "hub_types",
    "HubState": "hub_types",
    "HubStatistics": "hub_types",
    "Keepalives": "keepalive",
    "NotAccepting": "errors",
    "PolicyName": "policy",
    "ScopeFeed": "scope_feed",
    "ScopeWatcher": "scope_watcher",
    "ScopeItem": "scope_watcher",
    "ScopeFrame": "scope_types",
    "ScopeMoment": "scope_types",
    "ScopePool": "scope_types",
    "ScopeRow": "scope_types",
    "ScopeStep": "scope_types",
    "SSEParser": "sse",
    "ServerSentEvent": "sse",
    "RunStep": "hub_types",
    "StepEngine": "hub_types",
    "StreamEnd": "stream",
    "StreamError": "stream",
    "StreamItem": "stream",
    "StreamState": "stream",
    "StreamStatistics": "stream",
    "TokenStream": "stream",
    "WaitingLimitReached": "errors",
    "encode_comment": "sse",
    "encode_event": "sse",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "DeadlineUnmeetable",
    "ErrorType",
    "Hub",
    "HubError",
    "HubSettings",
    "HubState",
    "HubStatistics",
    "Keepalives",
    "NotAccepting",
    "PolicyName",
    "RunStep",
    "SSEParser",
    "ScopeFeed",
    "ScopeFrame",
    "ScopeItem",
    "ScopeMoment",
    "ScopePool",
    "ScopeRow",
    "ScopeStep",
    "ScopeWatcher",
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

"""Streams: the hub that steps the engine, per-request token streams, slow-reader
policies, and the SSE codec.

Knows Trio and the engine's plain data types; never imports torch, transformers,
Quart, hypercorn or ``app``. Other packages import only from this package root.
"""

from __future__ import annotations

from .error_type import ErrorType as ErrorType
from .errors import DeadlineUnmeetable as DeadlineUnmeetable
from .errors import HubError as HubError
from .errors import NotAccepting as NotAccepting
from .errors import WaitingLimitReached as WaitingLimitReached
from .hub import Hub as Hub
from .hub_types import HubSettings as HubSettings
from .hub_types import HubState as HubState
from .hub_types import HubStatistics as HubStatistics
from .hub_types import StepEngine as StepEngine
from .policy import PolicyName as PolicyName
from .resume_log import EventLog as EventLog
from .resume_log import MemoryEventLog as MemoryEventLog
from .resume_log import SharedEventLog as SharedEventLog
from .resume_log import StoreUnavailable as StoreUnavailable
from .resumption import BadPosition as BadPosition
from .resumption import Draining as Draining
from .resumption import Holding as Holding
from .resumption import LoggedEvent as LoggedEvent
from .resumption import NothingToResume as NothingToResume
from .resumption import OwnerGone as OwnerGone
from .resumption import Reader as Reader
from .resumption import ReaderBusy as ReaderBusy
from .resumption import Rebuild as Rebuild
from .resumption import RemoteReader as RemoteReader
from .resumption import ResumeError as ResumeError
from .resumption import ResumeRegistry as ResumeRegistry
from .resumption import ResumeStatistics as ResumeStatistics
from .resumption import TakenOver as TakenOver
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

__all__ = [
    "BadPosition",
    "DeadlineUnmeetable",
    "Draining",
    "ErrorType",
    "EventLog",
    "Holding",
    "Hub",
    "HubError",
    "HubSettings",
    "HubState",
    "HubStatistics",
    "LoggedEvent",
    "MemoryEventLog",
    "NotAccepting",
    "NothingToResume",
    "OwnerGone",
    "PolicyName",
    "Reader",
    "ReaderBusy",
    "Rebuild",
    "RemoteReader",
    "ResumeError",
    "ResumeRegistry",
    "ResumeStatistics",
    "SSEParser",
    "ServerSentEvent",
    "SharedEventLog",
    "StepEngine",
    "StoreUnavailable",
    "StreamEnd",
    "StreamError",
    "StreamItem",
    "StreamState",
    "StreamStatistics",
    "TakenOver",
    "TokenStream",
    "WaitingLimitReached",
    "encode_comment",
    "encode_event",
]

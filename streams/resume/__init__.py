"""Resumable streams: a stream that outlives its connection, read again from a position.

Other packages import resume names only from here. ``RedisEventLog`` and ``RedisStore``
(a replica's one client and signer for the shared Redis) load lazily (module
``__getattr__``) so that importing this package never loads ``redis``; only using the
Redis store does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import BadPosition as BadPosition
from .errors import Draining as Draining
from .errors import NothingToResume as NothingToResume
from .errors import ReaderBusy as ReaderBusy
from .errors import ResumeError as ResumeError
from .errors import StoreRejected as StoreRejected
from .errors import TakenOver as TakenOver
from .errors import WriterGone as WriterGone
from .log import EventLog as EventLog
from .log import MemoryEventLog as MemoryEventLog
from .log import SharedEventLog as SharedEventLog
from .log import StoreStatistics as StoreStatistics
from .log import StoreUnavailable as StoreUnavailable
from .reader import Reader as Reader
from .records import Adopt as Adopt
from .records import Holding as Holding
from .records import LoggedEvent as LoggedEvent
from .records import Rebuild as Rebuild
from .records import ResumeStatistics as ResumeStatistics
from .registry import ResumeRegistry as ResumeRegistry
from .remote_reader import RemoteReader as RemoteReader
from .spec import generated_ids as generated_ids
from .spec import spec_of as spec_of
from .spec import spec_parts as spec_parts
from .spec import with_seed as with_seed

if TYPE_CHECKING:
    from .redis_log import RedisEventLog as RedisEventLog
    from .redis_store import RedisStore as RedisStore


def __getattr__(name: str) -> Any:
    if name == "RedisEventLog":
        from .redis_log import RedisEventLog

        return RedisEventLog
    if name == "RedisStore":
        from .redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Adopt",
    "BadPosition",
    "Draining",
    "EventLog",
    "Holding",
    "LoggedEvent",
    "MemoryEventLog",
    "NothingToResume",
    "Reader",
    "ReaderBusy",
    "Rebuild",
    "RedisEventLog",
    "RedisStore",
    "RemoteReader",
    "ResumeError",
    "ResumeRegistry",
    "ResumeStatistics",
    "SharedEventLog",
    "StoreRejected",
    "StoreStatistics",
    "StoreUnavailable",
    "TakenOver",
    "WriterGone",
    "generated_ids",
    "spec_of",
    "spec_parts",
    "with_seed",
]

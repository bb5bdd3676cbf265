"""The drain's hand-over: a replica going away leaves its running streams to another.

Shortly before the drain's deadline, the streams still running are handed over instead
of ending with ``shutdown``: each is closed here (the engine is asked to cancel it, as
for a client gone), forgotten here only (its keys in the store stay), and once every
event it logged is in the store its writer lease is let go (compare-and-delete, in the
same ordered batches), so a resume on another replica takes it over at once and
continues it with the same tokens, as after a death. Its reader here, if any, ends
without a final event, like the remote readers the drain cut: the client resumes.
"""

from __future__ import annotations

from .local import LocalStreams
from .log import SharedEventLog
from .records import Holding


def leave_to_another_replica(log: SharedEventLog, local: LocalStreams) -> int:
    """Leave each published stream that has not ended to another replica; how many.
    Sync, never a checkpoint: the caller then waits for ``log.stored()``, after which
    the store has every event they logged and their writer leases are let go."""
    leaving = [e for e in local.entries()
               if e.published and not e.is_ended and e.holding is not Holding.GONE]
    for entry in leaving:
        log.release_local_reader(entry.request_id)
        local.forget(entry, disowned=True)  # this replica's copy only
        log.release_writer(entry.request_id)  # queued after every event it logged
    return len(leaving)

"""Where the Redis log keeps a stream: its keys, and the Lua scripts that change them.

One Redis stream per resumable stream, entry id ``0-<n>`` (the event's number: XADD with
an explicit id refuses an id at or below the last, so the store itself never holds a
duplicate or an out-of-order event), fields ``d`` (the encoded SSE event), ``e`` (``1``
on the stream's last event) and ``m`` (its HMAC, ``signing.py``). Beside it, the reader
lease, the writer lease, the rebuild spec (signed) and a cancel mark.

Why Redis Streams and not lists: XRANGE from an id replays exactly the events after a
position (a list would need the index arithmetic, and nothing refuses a duplicate), and
XREAD BLOCK from that id follows new events with no lost wake-up (an entry appended
between the replay and the block is returned at once); pub/sub would need a second
connection per follower and loses what is published while it is not subscribed.

The key layout is stored data (other replicas, and replicas of an older version, read
it), so it never changes with a code name: the writer lease lives at ``...:owner`` as it
always did. The braces keep every key of one stream in one Redis Cluster slot. The
scripts are ``lua/*.lua`` beside this module (package data), each one atomic operation
that a plain command cannot be (compare-and-renew, compare-and-delete, the takeover, a
cancel from another replica).
"""

from __future__ import annotations

from importlib import resources

KEY_PREFIX = "streamscope:"


def events_key(stream_id: str) -> str:
    """The stream's events: a Redis stream, entry id ``0-<n>``."""
    return f"{KEY_PREFIX}{{{stream_id}}}:events"


def reader_key(stream_id: str) -> str:
    """The reader lease: the token of the one reader, on any replica."""
    return f"{KEY_PREFIX}{{{stream_id}}}:reader"


def writer_key(stream_id: str) -> str:
    """The writer lease: the token of the replica whose engine generates the stream."""
    return f"{KEY_PREFIX}{{{stream_id}}}:owner"  # stored data: the name stays


def spec_key(stream_id: str) -> str:
    """What a rebuild needs (``spec.spec_of``)."""
    return f"{KEY_PREFIX}{{{stream_id}}}:spec"


def cancel_key(stream_id: str) -> str:
    """A cancel mark: ``DELETE`` on a replica that does not generate the stream; its
    writer finds it at its next renewal, ends the stream and deletes its keys."""
    return f"{KEY_PREFIX}{{{stream_id}}}:cancel"


def stream_keys(stream_id: str) -> list[str]:
    """Every key of a stream, in the order the scripts take them: the writer lease, the
    events, the spec, the reader lease, the cancel mark."""
    return [writer_key(stream_id), events_key(stream_id), spec_key(stream_id),
            reader_key(stream_id), cancel_key(stream_id)]


def lua(name: str) -> str:
    """The text of ``lua/<name>.lua``."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")

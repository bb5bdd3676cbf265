"""Where the Redis log keeps a stream: its keys, and the Lua scripts that change them.

The key layout is stored data (other replicas, and replicas of an older version, read
it), so it never changes with a code name: the writer lease lives at ``...:owner`` as it
always did. The braces keep every key of one stream in one Redis Cluster slot. The
scripts are ``lua/*.lua`` beside this module (package data), each one atomic operation
that a plain command cannot be (compare-and-renew, compare-and-delete, the takeover).
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


def lua(name: str) -> str:
    """The text of ``lua/<name>.lua``."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")

"""The Redis log's reads, each run in a worker thread: entries read back and checked.

Every entry a reader or a rebuild gets is checked against its HMAC (``signing.py``)
before anyone sees its bytes: one that fails raises ``StoreRejected``. ``tail`` alone
reads an entry's number and flag unchecked: they steer where a reader starts and
whether a takeover is due, and its bytes reach no client and no engine (a forged tail
makes a stream look ended or not, which deleting its keys could do as well).
"""

from __future__ import annotations

from typing import Any

import redis

from .errors import StoreRejected
from .redis_keys import cancel_key, events_key, spec_key, writer_key
from .signing import StoreSigner

Entry = tuple[int, bytes, bool]  # (n, data, last)


def entry_fields(signer: StoreSigner, stream_id: str, n: int, data: bytes,
                 last: bool) -> dict[str, bytes]:
    """The fields of event ``n``'s entry: its bytes, its flag, its HMAC."""
    return {"d": data, "e": b"1" if last else b"0",
            "m": signer.event_mac(stream_id, n, data, last)}


def unchecked(entry: Any) -> Entry:
    """(n, data, last) of one XRANGE/XREAD entry ``(b"0-<n>", {b"d": ..., b"e": ...})``."""
    entry_id, fields = entry
    return int(entry_id.split(b"-")[1]), fields[b"d"], fields[b"e"] == b"1"


def checked(signer: StoreSigner, stream_id: str, entry: Any) -> Entry:
    """``unchecked``, once its HMAC matched (else ``StoreRejected``)."""
    n, data, last = unchecked(entry)
    signer.check_event(stream_id, n, data, last, entry[1].get(b"m"))
    return n, data, last


def read_after(client: redis.Redis, signer: StoreSigner, stream_id: str, after: int,
               wait_ms: int) -> list[Entry] | None:
    """The replay (XRANGE) after ``after``, else a block (XREAD) for the next; None if
    the stream's events are gone. The entries checked, up to the first that fails
    (``StoreRejected`` if that is the first)."""
    key = events_key(stream_id)
    entries: Any = client.xrange(key, f"(0-{after}", "+")
    if not entries:
        if not client.exists(key):
            return None
        answer: Any = client.xread({key: f"0-{after}"}, block=wait_ms)
        if isinstance(answer, dict):  # RESP3: {key: [entries]}
            entries = next(iter(answer.values()), [])
        else:  # RESP2: [[key, [entries]]]
            entries = answer[0][1] if answer else []
    good: list[Entry] = []
    for entry in entries:
        try:
            good.append(checked(signer, stream_id, entry))
        except StoreRejected:
            if not good:
                raise
            break  # those before it first; the next read starts at it, and raises
    return good


def read_for_rebuild(client: redis.Redis, signer: StoreSigner,
                     stream_id: str) -> tuple[bytes, list[Entry]] | None:
    """(the spec, every event), each checked; None if either is gone."""
    stored: Any = client.get(spec_key(stream_id))
    entries: Any = client.xrange(events_key(stream_id), "-", "+")
    if stored is None or not entries:
        return None
    return (signer.open_spec(stream_id, stored),
            [checked(signer, stream_id, e) for e in entries])


def renew_and_look(client: redis.Redis, renew: Any, token: str, writing: list[str],
                   held: list[str], lease_ms: int) -> tuple[list[bool], list[bool]]:
    """One pipeline: the compare-and-renew of each writer lease in ``writing``, and
    whether each stream in ``held`` has a cancel mark (a DELETE on another replica)."""
    pipe = client.pipeline(transaction=False)
    for stream_id in writing:
        renew(keys=[writer_key(stream_id)], args=[token, lease_ms], client=pipe)
    for stream_id in held:
        pipe.exists(cancel_key(stream_id))
    results = pipe.execute()
    return ([bool(r) for r in results[:len(writing)]],
            [bool(r) for r in results[len(writing):]])

"""What the replicas write to the shared store, authenticated: HMAC-SHA256 with their key.

Anyone who can write to the store (Redis) could otherwise make the next replica asked for
a stream run whatever request a key holds, and have it replay any bytes to the stream's
readers. So every replica signs what it writes with a key derived from a secret they all
share (``STREAMSCOPE_RESUME_SECRET``), and checks it on every read:

- a stream's rebuild spec is stored as ``2:<hex HMAC>:<spec>``, the HMAC over the
  stream's id and the spec (a spec copied to another stream's key fails);
- every event entry carries field ``m``, the HMAC over the stream's id, the event's
  number, its last-event flag and its bytes (an event moved to another stream or
  position, a flag flipped, a byte changed: each fails);
- any other value a replica keeps in the store under a name (the Responses API's stored
  responses, ``app.runtime.responses_store``) is stored as ``2:<hex HMAC>:<value>``, the
  HMAC over its kind, its name and the value (``sign_value``, ``open_value``): a value
  copied to another name, or passed off as another kind (a stored response as a spec),
  fails. A spec is the value of kind ``spec`` under its stream's id.

What fails its check is refused (``StoreRejected``), never served or run. What is not
signed: the leases and marks (tokens, cancel marks; a forged one can stop or steal a
stream, as deleting keys can: that is what Redis' own access control is for) and the
order of a stream's entries beyond their numbers (an attacker can drop a stream's last
entries: a reader then waits, or a rebuild makes them again, the same tokens). An old
stream's signed entries written again replay a stream that really was: the same bytes.

The key: HMAC-SHA256 of a fixed label under the secret, so the secret itself is used
for nothing else. Knows no Redis and no Trio.
"""

from __future__ import annotations

import hmac

from .errors import StoreRejected

MIN_SECRET_CHARS = 32
_LABEL = b"streamscope resume store v1"
_VALUE_PREFIX = b"2:"
_MAC_HEX = 64  # hex digits of an HMAC-SHA256


class StoreSigner:
    """Signs and checks what the replicas store (see the module docstring).

    Raises:
        ValueError: ``secret`` is shorter than ``MIN_SECRET_CHARS``.
    """

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode() if isinstance(secret, str) else secret
        if len(raw) < MIN_SECRET_CHARS:
            raise ValueError(f"the resume secret needs at least {MIN_SECRET_CHARS} characters")
        self._key = hmac.digest(raw, _LABEL, "sha256")

    def sign_spec(self, stream_id: str, spec: bytes) -> bytes:
        """The stored form of a stream's spec."""
        return self.sign_value("spec", stream_id, spec)

    def open_spec(self, stream_id: str, stored: bytes) -> bytes:
        """The spec of its stored form. Raises StoreRejected: unsigned, or it fails."""
        return self.open_value("spec", stream_id, stored)

    def sign_value(self, kind: str, name: str, value: bytes) -> bytes:
        """The stored form of ``value``, a ``kind`` of thing kept under ``name``
        (``kind``: a fixed word of the caller's, such as ``spec`` or ``response``)."""
        return _VALUE_PREFIX + self._mac(_kind(kind), name, value).hex().encode() + b":" + value

    def open_value(self, kind: str, name: str, stored: bytes) -> bytes:
        """The value of its stored form (``sign_value``). Raises StoreRejected: unsigned,
        or it fails (altered, another name's or another kind's, another secret's)."""
        head, mac, colon = stored[:2], stored[2:2 + _MAC_HEX], stored[2 + _MAC_HEX:3 + _MAC_HEX]
        value = stored[3 + _MAC_HEX:]
        expected = self._mac(_kind(kind), name, value).hex().encode()
        if head != _VALUE_PREFIX or colon != b":" or not hmac.compare_digest(mac, expected):
            raise StoreRejected(f"the stored {kind} {name[:64]!r} fails its HMAC: unsigned, "
                                "altered, or signed with another resume secret")
        return value

    def event_mac(self, stream_id: str, n: int, data: bytes, last: bool) -> bytes:
        """Field ``m`` of event ``n``'s entry."""
        return self._mac(b"event", stream_id, b"%d:%d:" % (n, last) + data)

    def check_event(self, stream_id: str, n: int, data: bytes, last: bool,
                    mac: bytes | None) -> None:
        """Raises StoreRejected unless ``mac`` is event ``n``'s."""
        if mac is None or not hmac.compare_digest(mac, self.event_mac(stream_id, n, data, last)):
            raise StoreRejected(f"event {n} of stream {stream_id[:64]!r} in the store fails "
                                "its HMAC: unsigned, altered, or signed with another resume "
                                "secret")

    def _mac(self, kind: bytes, stream_id: str, payload: bytes) -> bytes:
        # ``stream_id``: the name the signed thing is kept under (a stream's id for a
        # spec or an event, a response's id for a stored response).
        ident = stream_id.encode()
        message = b"%s:%d:%s:%s" % (kind, len(ident), ident, payload)  # unambiguous
        return hmac.digest(self._key, message, "sha256")


def _kind(kind: str) -> bytes:
    """A value's kind as the MAC's first field: a word, so it cannot run into the next
    field (``event`` is the events' own, signed over more than a value)."""
    if not (kind.isascii() and kind.isalpha()) or kind == "event":
        raise ValueError(f"a stored value's kind is a word other than 'event', not {kind!r}")
    return kind.encode()

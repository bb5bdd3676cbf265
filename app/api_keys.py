"""API keys: what a key is, the keys it derives, a stream's read token, owned request ids.

Pure: hashlib, hmac and ``settings_json``'s JSON, no web framework and no clock of its
own (``now`` is passed in), so that ``settings.py`` validates with it and ``auth.py``
(the HTTP side) uses it.

Keys. ``STREAMSCOPE_API_KEY`` is one key (named ``default``); ``STREAMSCOPE_API_KEYS``
adds more, each with a name and, optionally, the most streams it may hold open at once,
as a JSON list (a key without one, and ``STREAMSCOPE_API_KEY``, gets the server's
``key_max_streams``: ``Credential(default_max_streams=)``)::

    [{"name": "ci", "key": "<at least 32 characters>", "max_streams": 4},
     {"name": "page", "key": "<another>"}]

A key is visible ASCII (what arrives intact in an ``Authorization`` header), at least
``MIN_KEY_CHARS`` long: a short key is guessed, and it is the secret every read token
and every owned id derives from. Names and keys are unique; errors name the entry,
never a key.

Derived keys, HKDF-style (``HMAC-SHA256(api_key, label)``, one label each): the *token
key* signs read tokens, the *owner key* tags owned ids, the *cache key* names the key's
prefix-cache namespaces (``cache_namespace``). None is the API key, none opens anything
another does, and a token in a log does not give the key away. Every replica with the
same keys derives the same ones: a stream rebuilt elsewhere finds its key's blocks.

Read token (``stream_token``): ``<expiry>.<mac>``, the expiry in whole Unix seconds (a
wall clock, so that every replica and a restarted one read it alike), the mac
``HMAC-SHA256(token key, "<request_id>.<expiry>")`` in hex. It opens one stream's ``GET``
until its expiry; an altered expiry breaks the mac.

Owned ids (``new_owned_id``): a resumable stream made with a key gets the request id
``<16 hex random><16 hex HMAC(owner key, random)>``, 32 hex digits like every other id,
so any replica with the same keys tells, from the id alone and with nothing stored,
whether a key made it (``owns``). A made-up id, or one of another key, is not owned.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from .settings_json import json_setting

MIN_KEY_CHARS = 32
MAX_NAME_CHARS = 64
SINGLE_KEY_NAME = "default"  # STREAMSCOPE_API_KEY's name
TOKEN_LABEL = b"streamscope stream token"
OWNER_LABEL = b"streamscope stream owner"
CACHE_LABEL = b"streamscope prefix cache"
# The keyless server's one tenant: its cache key (a constant: nothing to keep apart).
KEYLESS_CACHE_KEY = b"streamscope keyless prefix cache"
_RANDOM_HEX = 16  # an owned id: this many random hex digits, then as many of its tag
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_FIELDS = frozenset({"name", "key", "max_streams"})
_EXPECTED = 'a JSON list of {"name", "key", "max_streams"} objects'  # what a refusal asks


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One API key: its name (in logs and refusals), the key, its limit (None: none)."""

    name: str
    key: str = field(repr=False)
    max_streams: int | None = None


def check_key(key: object) -> str:
    """``key`` if it is a usable API key. Raises: ValueError saying why (not the key)."""
    if not isinstance(key, str) or not all("!" <= c <= "~" for c in key) or not key:
        raise ValueError("expected visible ASCII characters (no spaces)")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(
            f"too short: an API key must be at least {MIN_KEY_CHARS} characters (a short "
            f"key can be guessed); make one with: python -c 'import secrets; "
            f"print(secrets.token_urlsafe(32))'")
    return key


def parse_api_keys(value: object) -> tuple[ApiKey, ...]:
    """STREAMSCOPE_API_KEYS (JSON text) or a list of ApiKey or dicts, checked.

    Raises: ValueError naming the entry (its position and name) and the problem.
    """
    value = json_setting(value, _EXPECTED)
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected {_EXPECTED}")
    keys = tuple(_entry(n, entry) for n, entry in enumerate(value, start=1))
    for what, values in (("name", [k.name for k in keys]), ("key", [k.key for k in keys])):
        if len(set(values)) != len(values):
            raise ValueError(f"two entries have the same {what}")
    return keys


def _entry(n: int, entry: object) -> ApiKey:
    if isinstance(entry, ApiKey):
        entry = {"name": entry.name, "key": entry.key, "max_streams": entry.max_streams}
    if not isinstance(entry, dict) or not {"name", "key"} <= entry.keys() <= _FIELDS:
        raise ValueError(f"entry {n}: expected an object with name, key and optionally "
                         f"max_streams, and nothing else")
    name, limit = entry["name"], entry.get("max_streams")
    if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS
            and set(name) <= _NAME_CHARS):
        raise ValueError(f"entry {n}: the name must be 1 to {MAX_NAME_CHARS} letters, "
                         f"digits, '.', '_' or '-'")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise ValueError(f"entry {n} ({name}): max_streams must be a whole number >= 1")
    try:
        key = check_key(entry["key"])
    except ValueError as exc:
        raise ValueError(f"entry {n} ({name}): the key: {exc}") from None
    return ApiKey(name, key, limit)


def all_keys(api_key: str | None, api_keys: Iterable[ApiKey]) -> tuple[ApiKey, ...]:
    """The server's keys: ``api_key`` (as ``default``, no limit of its own) first, then the rest.

    Raises: ValueError if ``api_key`` is also one of ``api_keys`` or a name repeats.
    """
    keys = tuple(api_keys)
    if api_key is None:
        return keys
    if any(k.key == api_key for k in keys) or any(k.name == SINGLE_KEY_NAME for k in keys):
        raise ValueError(f"STREAMSCOPE_API_KEY is also in STREAMSCOPE_API_KEYS, or an entry "
                         f"there is named {SINGLE_KEY_NAME!r}")
    return (ApiKey(SINGLE_KEY_NAME, api_key), *keys)


def derive(key: str, label: bytes) -> bytes:
    """A key of its own for one use (``label``), from an API key."""
    return hmac.new(key.encode("ascii"), label, hashlib.sha256).digest()


class Credential:
    """One key as the server checks it: its digest and its derived keys, never the key.

    All comparisons are ``hmac.compare_digest`` over fixed-length values.
    """

    __slots__ = ("_digest", "_owner_key", "_token_key", "cache_key", "max_streams", "name")

    def __init__(self, key: ApiKey, *, default_max_streams: int | None = None) -> None:
        self.name = key.name
        self.max_streams = default_max_streams if key.max_streams is None else key.max_streams
        self._digest = hashlib.sha256(key.key.encode("ascii")).digest()
        self._token_key = derive(key.key, TOKEN_LABEL)
        self._owner_key = derive(key.key, OWNER_LABEL)
        self.cache_key = derive(key.key, CACHE_LABEL)

    def matches(self, presented: bytes) -> bool:
        """Whether ``presented`` (a bearer token's bytes) is this key (constant time)."""
        return hmac.compare_digest(hashlib.sha256(presented).digest(), self._digest)

    def stream_token(self, request_id: str, expiry: int) -> str:
        """The read token of ``request_id`` until ``expiry`` (Unix seconds)."""
        return f"{expiry}.{self._token_mac(request_id, expiry)}"

    def token_opens(self, token: str, request_id: str, now: float) -> bool:
        """Whether ``token`` is this key's read token of ``request_id``, unexpired."""
        expiry_text, dot, mac = token.partition(".")
        if not dot or not (expiry_text.isascii() and expiry_text.isdigit()) \
                or len(expiry_text) > 12 or not mac.isascii():
            return False
        expiry = int(expiry_text)
        valid = hmac.compare_digest(mac.encode("ascii"),
                                    self._token_mac(request_id, expiry).encode("ascii"))
        return valid and now <= expiry

    def new_owned_id(self) -> str:
        """A new request id that this key owns (see the module docstring)."""
        random = secrets.token_hex(_RANDOM_HEX // 2)
        return random + self._owner_tag(random)

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` is one this key made (``new_owned_id``)."""
        if len(request_id) != 2 * _RANDOM_HEX or not request_id.isascii():
            return False
        random, tag = request_id[:_RANDOM_HEX], request_id[_RANDOM_HEX:]
        return hmac.compare_digest(tag.encode("ascii"), self._owner_tag(random).encode("ascii"))

    def _token_mac(self, request_id: str, expiry: int) -> str:
        message = f"{request_id}.{expiry}".encode()
        return hmac.new(self._token_key, message, hashlib.sha256).hexdigest()

    def _owner_tag(self, random: str) -> str:
        return hmac.new(self._owner_key, random.encode("ascii"),
                        hashlib.sha256).hexdigest()[:_RANDOM_HEX]


def cache_namespace(cache_key: bytes, salt: bytes) -> bytes:
    """The prefix-cache namespace of a key (its ``cache_key``) and a request's
    ``cache_salt`` (b"" for none): ``HMAC-SHA256(cache_key, "cache_salt:" + salt)``, so
    that no two keys, and no two salts of one key, share a cached block."""
    return hmac.new(cache_key, b"cache_salt:" + salt, hashlib.sha256).digest()


def token_expiry(now: float, ttl_s: float) -> int:
    """The expiry of a token made at ``now`` that lasts ``ttl_s``, in whole seconds."""
    return math.ceil(now + ttl_s)

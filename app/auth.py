"""Bearer-token auth (``STREAMSCOPE_API_KEY``, ``STREAMSCOPE_API_KEYS``; off when unset),
per-key limits, and the binding of resumable streams to the key that made them.

With a key set, every request except ``OPEN_PATHS`` must carry
``Authorization: Bearer <key>`` (what the OpenAI SDKs send for ``api_key=``), one of the
server's keys (``api_keys.py``), else it is answered 401 ``unauthorized`` with
``WWW-Authenticate: Bearer`` (``errors.py``). The check is a ``before_request`` hook, so
it runs before a view reads the body, and it also covers unknown paths (a 401, not a
404: no route list for strangers). The request's ``Access`` (which key let it in) is
kept in ``quart.g`` for the views.

Per-key limits. A key with ``max_streams`` holds at most that many streams at once:
each of its ``POST`` requests (every route that opens a stream or a generation) takes a
``Slot`` before its body is read, owned by the request's connection (``edge.own``) and
given back when the request ends; a resumable stream takes its request's slot over
(``observer``) and gives it back at its last event or when the registry forgets it, so
its streams generating with no reader count too. Past the limit: 429
``too_many_streams`` with ``Retry-After``, before the first byte.

Binding. Every request made with a key (a stream, a whole answer, a resumable stream)
gets an id that key owns (``owned_request``: ``api_keys.Credential.new_owned_id``);
``check_owner`` answers another key's read, take-over (``GET /v1/stream/<id>``) or
``DELETE`` with 404 ``not_found``, as for an id that never was, on any replica (the id
alone says who owns it), and ``GET /v1/requests/<id>`` answers another key's request
(``may_see``) as one it never heard of.

The browser page (``routes/page.py``) reads a stream with ``EventSource``, which cannot send
headers. So ``POST /v1/requests`` (made with a key) answers a ``stream_url`` that
carries a read token of that one stream, ``?token=<expiry>.<mac>`` (``stream_query``),
which ``GET /v1/stream/<id>`` accepts instead of the key until it expires
(``stream_token_ttl_s``): it reads that stream only, never creates, cancels or reads
another. The token is signed with a key derived from the API key, never the key itself,
which never travels in a cookie (browsers send a cookie to every port of the host) nor in
a URL. The page itself and its script show no request data and are open.

The comparisons are ``hmac.compare_digest``, the key's over SHA-256 digests, each key
compared: their time depends on neither the secret's value nor its length.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from quart import Quart, g, request

from engine import FinishEvent, GenerationRequest
from streams import StreamError, StreamItem

from .api_keys import Credential, all_keys, token_expiry
from .edge.connection import own
from .errors import ApiError, ErrorType
from .metrics import RequestTimer
from .settings import Settings

# Probes and scrapers (load balancers, orchestrators, Prometheus) carry no key, nor does
# a browser loading the page (routes/page.py); these show no request data.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/", "/page.js"})
# EventSource sends no headers: the one route a stream's read token opens, for that id.
STREAM_READ_PREFIX = "/v1/stream/"
STREAM_TOKEN_PARAM = "token"
# A key at its limit: a stream of its own must end first; most are short.
LIMIT_RETRY_AFTER_S = 1.0
_ACCESS = "streamscope_access"  # the quart.g attribute


@dataclass(slots=True)
class Access:
    """What let this request in: a key (None: a stream's read token), and its slot."""

    credential: Credential | None
    slot: Slot | None
    token_ttl_s: float


class KeyUsage:
    """How many streams each key holds now (for the keys with a limit)."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def take(self, credential: Credential) -> Slot:
        """A slot of ``credential``'s. Raises: ApiError 429 too_many_streams."""
        limit, held = credential.max_streams, self.open.get(credential.name, 0)
        if limit is not None and held >= limit:
            raise ApiError(ErrorType.TOO_MANY_STREAMS,
                           f"the API key {credential.name!r} holds {held} streams, its "
                           f"limit; end one or wait for one to end",
                           retry_after_s=LIMIT_RETRY_AFTER_S)
        self.open[credential.name] = held + 1
        return Slot(self, credential.name)

    def give_back(self, name: str) -> None:
        self.open[name] -= 1
        if not self.open[name]:
            del self.open[name]


class Slot:
    """One stream's place in its key's count; ``close()`` gives it back, once.
    Sync, idempotent, never a checkpoint (a connection closes it on every way out)."""

    __slots__ = ("_name", "_usage")

    def __init__(self, usage: KeyUsage | None, name: str) -> None:
        self._usage = usage
        self._name = name

    def transfer(self) -> Slot:
        """A slot that holds this one's place; this one gives nothing back any more."""
        usage, self._usage = self._usage, None
        return Slot(usage, self._name)

    def close(self) -> None:
        usage, self._usage = self._usage, None
        if usage is not None:
            usage.give_back(self._name)


class SlotObserver:
    """A resumable stream's observer (the metrics timer) that also holds its key's slot:
    given back at the stream's last event, or when the registry forgets the stream."""

    __slots__ = ("_inner", "_slot")

    def __init__(self, inner: RequestTimer, slot: Slot) -> None:
        self._inner = inner
        self._slot = slot

    def observe(self, item: StreamItem) -> None:
        self._inner.observe(item)
        if isinstance(item, FinishEvent | StreamError):
            self._slot.close()

    def close(self) -> None:
        self._slot.close()
        self._inner.close()


def register_auth(app: Quart, settings: Settings) -> None:
    """Require one of the settings' keys as a bearer token on every route but
    ``OPEN_PATHS``, and count the keys' streams; no key set: off."""
    credentials = [Credential(k) for k in all_keys(settings.api_key, settings.api_keys)]
    if not credentials:
        return
    usage = KeyUsage()
    ttl_s = settings.stream_token_ttl_s

    @app.before_request
    async def require_api_key() -> None:
        """Raises ApiError unauthorized (401), too_many_streams (429). Cancellation: no
        checkpoint."""
        if request.path in OPEN_PATHS:
            return
        token = bearer_token(request.headers.get("Authorization", "")) or api_key_header()
        if token is None and _stream_token_valid(credentials):
            setattr(g, _ACCESS, Access(None, None, ttl_s))
            return
        # Headers arrive decoded as latin-1, so this gives back the bytes that were sent.
        presented = None if token is None else token.encode("latin-1")
        matched = [c for c in credentials if presented is not None and c.matches(presented)]
        if not matched:
            raise ApiError(
                ErrorType.UNAUTHORIZED,
                "a valid API key is required: send Authorization: Bearer <key>",
            )
        credential = matched[0]
        slot = None
        if request.method == "POST" and credential.max_streams is not None:
            slot = usage.take(credential)
            own(request.scope, slot)  # given back when the request ends, however
        setattr(g, _ACCESS, Access(credential, slot, ttl_s))


def _access() -> Access | None:
    """This request's access; None on a server without keys."""
    access: Access | None = getattr(g, _ACCESS, None)
    return access


def owned_request(generation: GenerationRequest) -> GenerationRequest:
    """``generation`` with an id that this request's key owns (unchanged without one)."""
    access = _access()
    if access is None or access.credential is None:
        return generation
    return dataclasses.replace(generation, request_id=access.credential.new_owned_id())


def key_name() -> str | None:
    """The name of this request's API key; None on a server without keys (what its
    stored responses are counted under, ``routes/responses.py``)."""
    access = _access()
    return None if access is None or access.credential is None else access.credential.name


def may_see(request_id: str) -> bool:
    """Whether this request may see ``request_id``: no key, or the key that made it."""
    access = _access()
    return access is None or access.credential is None or access.credential.owns(request_id)


def check_owner(request_id: str) -> None:
    """Refuse a request made with a key for a stream of another key (or none).

    Raises: ApiError 404 not_found, as for a stream that does not exist.
    """
    if not may_see(request_id):
        raise ApiError(ErrorType.NOT_FOUND,
                       f"no resumable request {request_id[:64]!r}: unknown or over")


def stream_query(request_id: str) -> str:
    """What a ``stream_url`` carries: ``?token=<read token>`` with a key, else nothing."""
    access = _access()
    if access is None or access.credential is None:
        return ""
    expiry = token_expiry(time.time(), access.token_ttl_s)
    return f"?{STREAM_TOKEN_PARAM}={access.credential.stream_token(request_id, expiry)}"


def observer(timer: RequestTimer) -> RequestTimer | SlotObserver:
    """What the resume registry is to tell of a stream this request makes: ``timer``,
    holding this request's slot (if its key has a limit) for as long as the stream."""
    access = _access()
    if access is None or access.slot is None:
        return timer
    return SlotObserver(timer, access.slot.transfer())


def _stream_token_valid(credentials: list[Credential]) -> bool:
    """Whether this request is ``GET /v1/stream/<id>?token=`` with ``<id>``'s token,
    unexpired, from one of the keys (each is tried)."""
    if request.method != "GET" or not request.path.startswith(STREAM_READ_PREFIX):
        return False
    request_id = request.path.removeprefix(STREAM_READ_PREFIX)
    given = request.args.get(STREAM_TOKEN_PARAM, "")
    if not request_id.isascii() or "/" in request_id or not given.isascii():
        return False
    now = time.time()
    return any([c.token_opens(given, request_id, now) for c in credentials])


def bearer_token(header: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme in any case)."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


# -- x-api-key: the Anthropic SDK's header (/v1/messages), accepted instead of the bearer --

API_KEY_HEADER = "x-api-key"


def api_key_header() -> str | None:
    """This request's ``x-api-key`` value, or None (absent or blank); checked exactly as
    a bearer token is. A request with both is judged by its bearer token."""
    return request.headers.get(API_KEY_HEADER, "").strip() or None

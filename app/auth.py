"""Bearer-token auth (``STREAMSCOPE_API_KEY``, ``STREAMSCOPE_API_KEYS``; off when unset),
per-key limits, and the binding of resumable streams to the key that made them.

With a key set, every request except ``OPEN_PATHS`` must carry
``Authorization: Bearer <key>`` (what the OpenAI SDKs send for ``api_key=``), one of the
server's keys (``api_keys.py``), else it is answered 401 ``unauthorized`` with
``WWW-Authenticate: Bearer`` (``errors.py``). The check is a ``before_request`` hook, so
it runs before a view reads the body, and it also covers unknown paths (a 401, not a
404: no route list for strangers). The request's ``Access`` (which key let it in) is
kept in ``quart.g`` for the views.

Per-key limits. A key holds at most its ``max_streams`` (else the server's
``key_max_streams``, which ``STREAMSCOPE_API_KEY`` gets too) streams at once:
each of its ``POST`` requests (every route that opens a stream or a generation) takes a
``Slot`` before its body is read, owned by the request's connection
(``edge.connection.close_with_connection``) and given back when the request ends; a resumable
stream takes its request's slot over (``observer``) and gives it back at its last event or when the
registry forgets it, so its streams generating with no reader count too. Past the limit: 429
``too_many_streams`` with ``Retry-After``, before the first byte. Its share of the
server-wide caps is ``key_shares.py``'s (429 ``key_limit``).

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

Tenants apart (docs/security.md): ``owned_request`` also puts every request in its key's
prefix-cache namespace (``api_keys.cache_namespace``, split further by the body's
``cache_salt``), so a key never finds another key's prompt cached; ``/metrics`` needs
``STREAMSCOPE_METRICS_TOKEN`` when it is set (``guard_metrics``).

The scope (``routes/scope.py``) reads its feed with ``EventSource`` too: ``GET
/scope/token``, made with a key, answers the feed's URL with a read token of the id
``SCOPE_TOKEN_ID`` (which no stream's id can be), which opens ``GET /scope/events`` alone,
as that key (``key_name``): a key sees its own streams there unless the operator named it
in ``scope_operator_keys``. The scope's page and script are open, like ``/``.

The comparisons are ``hmac.compare_digest``, the key's over SHA-256 digests, each key
compared: their time depends on neither the secret's value nor its length.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from quart import Quart, g, request

from engine import GenerationRequest

from .api_keys import (
    KEYLESS_CACHE_KEY,
    ApiKey,
    Credential,
    cache_namespace,
    token_expiry,
)
from .edge.connection import close_with_connection
from .errors import ApiError, ErrorType
from .key_shares import KeyShares, Slot, SlotObserver
from .metrics import RequestTimer
from .settings import Settings

# Probes and scrapers (load balancers, orchestrators, Prometheus) carry no key, nor does
# a browser loading the page (routes/page.py); these show no request data.
# /metrics needs STREAMSCOPE_METRICS_TOKEN instead, when it is set (guard_metrics).
METRICS_PATH = "/metrics"
OPEN_PATHS = frozenset({"/health", "/ready", METRICS_PATH, "/", "/page.js", "/scope",
                        "/scope.js"})
# EventSource sends no headers: the one route a stream's read token opens, for that id.
STREAM_READ_PREFIX = "/v1/stream/"
STREAM_TOKEN_PARAM = "token"
# The scope's feed (routes/scope.py), for EventSource: a read token of this id, which no
# stream's id can be (ids never hold "/"), opens it for the key that made the token.
SCOPE_EVENTS_PATH = "/scope/events"
SCOPE_TOKEN_ID = "/scope"
_ACCESS = "streamscope_access"  # the quart.g attribute


@dataclass(slots=True)
class Access:
    """What let this request in: a key (None: a stream's read token), and its slot."""

    credential: Credential | None
    slot: Slot | None
    token_ttl_s: float


def register_auth(app: Quart, settings: Settings, shares: KeyShares | None) -> None:
    """Require one of the keys (``shares``: the runtime's, from the settings) as a
    bearer token on every route but ``OPEN_PATHS``, and count the keys' streams; no
    key set (``shares`` None): off. With a metrics token, ``/metrics`` requires it
    (``guard_metrics``), keys or none."""
    if settings.metrics_token is not None:
        guard_metrics(app, settings.metrics_token)
    if shares is None:
        return
    credentials = list(shares.credentials)
    usage = shares.usage
    ttl_s = settings.stream_token_ttl_s

    @app.before_request
    async def require_api_key() -> None:
        """Raises ApiError unauthorized (401), too_many_streams (429). Cancellation:
        nothing to undo, as none can land: no checkpoint."""
        if request.path in OPEN_PATHS:
            return
        token = bearer_token(request.headers.get("Authorization", "")) or api_key_header()
        if token is None and _stream_token_valid(credentials):
            setattr(g, _ACCESS, Access(None, None, ttl_s))
            return
        scope_key = None if token is not None else _scope_token_key(credentials)
        if scope_key is not None:
            setattr(g, _ACCESS, Access(scope_key, None, ttl_s))
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
        if request.method == "POST":
            slot = usage.take(credential)
            close_with_connection(request.scope, slot)  # given back when the request ends, however
        setattr(g, _ACCESS, Access(credential, slot, ttl_s))


def guard_metrics(app: Quart, token: str) -> None:
    """``/metrics`` needs ``Authorization: Bearer <token>`` (the metrics token),
    compared as an API key is (``Credential.matches``); no API key opens it."""
    scraper = Credential(ApiKey("metrics", token))

    @app.before_request
    async def require_metrics_token() -> None:
        """Raises ApiError unauthorized (401). Cancellation: nothing to undo, as none can
        land: no checkpoint."""
        if request.path != METRICS_PATH:
            return
        presented = bearer_token(request.headers.get("Authorization", ""))
        if presented is None or not scraper.matches(presented.encode("latin-1")):
            raise ApiError(ErrorType.UNAUTHORIZED, "a valid metrics token is required: "
                           "send Authorization: Bearer <STREAMSCOPE_METRICS_TOKEN>")


def _access() -> Access | None:
    """This request's access; None on a server without keys."""
    access: Access | None = getattr(g, _ACCESS, None)
    return access


def owned_request(generation: GenerationRequest) -> GenerationRequest:
    """``generation`` with an id that this request's key owns (unchanged without one), in
    its key's prefix-cache namespace: ``cache_namespace`` holds the body's
    ``cache_salt`` (``schemas.salt_bytes``) and becomes the namespace of the key and that
    salt (``api_keys.cache_namespace``; the keyless server's one tenant has a fixed key),
    so that no key's request finds another key's prompt blocks cached. Its ``tenant`` is
    the key's name, whose share of the engine's work within a band is kept fair
    (``engine.priority``; "" on a server without keys)."""
    access = _access()
    credential = None if access is None else access.credential
    cache_key = KEYLESS_CACHE_KEY if credential is None else credential.cache_key
    namespace = cache_namespace(cache_key, generation.cache_namespace)
    if credential is None:
        return dataclasses.replace(generation, cache_namespace=namespace)
    return dataclasses.replace(generation, request_id=credential.new_owned_id(),
                               cache_namespace=namespace, tenant=credential.name)


def key_name() -> str | None:
    """The name of the key that let this request in; None on a server without keys
    (what its stored responses are counted under, and whose rows the scope shows)."""
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
    holding this request's slot of its key (with keys) for as long as the stream."""
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


def _scope_token_key(credentials: list[Credential]) -> Credential | None:
    """The key whose scope read token this ``GET /scope/events?token=`` carries,
    unexpired (each key is tried), or None."""
    if request.method != "GET" or request.path != SCOPE_EVENTS_PATH:
        return None
    given, now = request.args.get(STREAM_TOKEN_PARAM, ""), time.time()
    if not given.isascii():
        return None
    opened = [c for c in credentials if c.token_opens(given, SCOPE_TOKEN_ID, now)]
    return opened[0] if opened else None


def scope_query() -> str:
    """What the scope feed's URL carries for EventSource: ``?token=<read token>`` of
    this request's key, else nothing."""
    access = _access()
    if access is None or access.credential is None:
        return ""
    expiry = token_expiry(time.time(), access.token_ttl_s)
    token = access.credential.stream_token(SCOPE_TOKEN_ID, expiry)
    return f"?{STREAM_TOKEN_PARAM}={token}"


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

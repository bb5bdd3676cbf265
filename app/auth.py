"""Optional bearer-token auth: ``STREAMSCOPE_API_KEY`` (off when unset).

With a key set, every request except ``OPEN_PATHS`` must carry
``Authorization: Bearer <key>`` (what the OpenAI SDKs send for ``api_key=``), else it
is answered 401 ``unauthorized`` with ``WWW-Authenticate: Bearer`` (``errors.py``). The
check is a ``before_request`` hook, so it runs before a view reads the body, and it
also covers unknown paths (a 401, not a 404: no route list for strangers).

The browser page (``routes/page.py``) reads a stream with ``EventSource``, which cannot send
headers. So ``POST /v1/requests`` (made with the key) answers a ``stream_url`` that
carries a read token of that one stream, ``?token=<HMAC-SHA256(key, id), hex>``
(``stream_token``), and ``GET /v1/stream/<id>`` accepts that token instead of the key:
it reads that stream only, never creates, cancels or reads another. The key itself never
travels in a cookie (browsers send a cookie to every port of the host) nor in a URL.
The page itself and its script show no request data and are open.

The comparisons are ``hmac.compare_digest``, the key's over SHA-256 digests: their time
depends on neither the secret's value nor its length.
"""

from __future__ import annotations

import hashlib
import hmac

from quart import Quart, request

from .errors import ApiError, ErrorType

# Probes and scrapers (load balancers, orchestrators, Prometheus) carry no key, nor does
# a browser loading the page (routes/page.py); these show no request data.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/", "/page.js"})
# EventSource sends no headers: the one route a stream's read token opens, for that id.
STREAM_READ_PREFIX = "/v1/stream/"
STREAM_TOKEN_PARAM = "token"


def register_auth(app: Quart, api_key: str | None) -> None:
    """Require ``api_key`` as a bearer token on every route but ``OPEN_PATHS``; None: off."""
    if api_key is None:
        return
    expected = _digest(api_key.encode("ascii"))

    @app.before_request
    async def require_api_key() -> None:
        """Raises ApiError unauthorized (401). Cancellation: no checkpoint."""
        if request.path in OPEN_PATHS:
            return
        token = bearer_token(request.headers.get("Authorization", ""))
        if token is None and _stream_token_valid(api_key):
            return
        # Headers arrive decoded as latin-1, so this gives back the bytes that were sent.
        if token is None or not hmac.compare_digest(_digest(token.encode("latin-1")), expected):
            raise ApiError(
                ErrorType.UNAUTHORIZED,
                "a valid API key is required: send Authorization: Bearer <key>",
            )


def stream_token(api_key: str, request_id: str) -> str:
    """The read token of one stream: HMAC-SHA256 of its id under the key, in hex."""
    return hmac.new(api_key.encode("ascii"), request_id.encode("ascii"),
                    hashlib.sha256).hexdigest()


def _stream_token_valid(api_key: str) -> bool:
    """Whether this request is ``GET /v1/stream/<id>?token=`` with ``<id>``'s token."""
    if request.method != "GET" or not request.path.startswith(STREAM_READ_PREFIX):
        return False
    request_id = request.path.removeprefix(STREAM_READ_PREFIX)
    given = request.args.get(STREAM_TOKEN_PARAM, "")
    if not request_id.isascii() or "/" in request_id or not given.isascii():
        return False
    return hmac.compare_digest(given.encode("ascii"),
                               stream_token(api_key, request_id).encode("ascii"))


def bearer_token(header: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme in any case)."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()

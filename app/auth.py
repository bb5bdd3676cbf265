"""Optional bearer-token auth: ``STREAMSCOPE_API_KEY`` (off when unset).

With a key set, every request except ``OPEN_PATHS`` must carry
``Authorization: Bearer <key>`` (what the OpenAI SDKs send for ``api_key=``), else it
is answered 401 ``unauthorized`` with ``WWW-Authenticate: Bearer`` (``errors.py``). The
check is a ``before_request`` hook, so it runs before a view reads the body, and it
also covers unknown paths (a 401, not a 404: no route list for strangers).

The browser page (``page.py``) reads a stream with ``EventSource``, which cannot send
headers: on ``GET /v1/stream/<id>`` only (reading a stream that a request with the key
created, never creating one) the key may instead come in the ``streamscope_key`` cookie
(percent-encoded), which the page sets for path ``/v1/stream`` with ``SameSite=Strict``.
The page itself and its script show no request data and are open.

The comparison is ``hmac.compare_digest`` over SHA-256 digests: its time depends on
neither the key's value nor its length.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import unquote

from quart import Quart, request

from .errors import ApiError, ErrorType

# Probes and scrapers (load balancers, orchestrators, Prometheus) carry no key, nor does
# a browser loading the page (page.py); these show no request data.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/", "/page.js"})
# EventSource sends cookies but no headers: where a page's stream reader may carry the key.
STREAM_KEY_COOKIE = "streamscope_key"
STREAM_READ_PREFIX = "/v1/stream/"


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
        if token is None and request.method == "GET" and request.path.startswith(
            STREAM_READ_PREFIX
        ):
            # latin-1: each byte one character, as for the header below
            token = unquote(request.cookies.get(STREAM_KEY_COOKIE, ""), "latin-1") or None
        # Headers arrive decoded as latin-1, so this gives back the bytes that were sent.
        if token is None or not hmac.compare_digest(_digest(token.encode("latin-1")), expected):
            raise ApiError(
                ErrorType.UNAUTHORIZED,
                "a valid API key is required: send Authorization: Bearer <key>",
            )


def bearer_token(header: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme in any case)."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()

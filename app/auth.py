"""Optional bearer-token auth: ``STREAMSCOPE_API_KEY`` (off when unset).

With a key set, every request except ``OPEN_PATHS`` must carry
``Authorization: Bearer <key>`` (what the OpenAI SDKs send for ``api_key=``), else it
is answered 401 ``unauthorized`` with ``WWW-Authenticate: Bearer`` (``errors.py``). The
check is a ``before_request`` hook, so it runs before a view reads the body, and it
also covers unknown paths (a 401, not a 404: no route list for strangers).

The comparison is ``hmac.compare_digest`` over SHA-256 digests: its time depends on
neither the key's value nor its length.
"""

from __future__ import annotations

import hashlib
import hmac

from quart import Quart, request

from .errors import ApiError, ErrorType

# Probes and scrapers (load balancers, orchestrators, Prometheus) carry no key; these
# show no request data.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


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

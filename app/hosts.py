"""The Host check of a server without an API key: DNS rebinding cannot reach it.

A keyless server trusts whoever can connect, and a loopback address looks private. A
page of ``evil.example`` whose name then resolves to ``127.0.0.1`` (DNS rebinding) makes
the visitor's browser send requests to that server and read the answers: same origin as
far as the browser knows, so no CORS preflight stops it. What gives it away is the
``Host`` header (HTTP/2's ``:authority``, which hypercorn hands over as ``host``), which
still names ``evil.example``. So, with no key set, only ``localhost``, ``127.0.0.1`` and
``[::1]`` (any port) are answered, plus ``STREAMSCOPE_ALLOWED_HOSTS`` (a name, any port;
or ``name:port``, that port only; ``*``: any) for a keyless server behind a proxy or
reached by another name. Anything else is 400 ``bad_request`` before any view runs.

A request that names no host (an empty ``Host:``, or none at all, as HTTP/1.0 allows) is
refused too (400): no browser sends one, and a check that lets a blank name through is
one a client can step around (``STREAMSCOPE_ALLOWED_HOSTS=*`` answers it). Not checked:
``/health`` and ``/ready``, which show no request data and which orchestrators probe by
the pod's address. With a key set the check is off: the key, which a rebinding page
does not have, is the protection, and servers with keys are reached by any name.
"""

from __future__ import annotations

import re

from quart import Quart, request

from .errors import ApiError, ErrorType
from .settings import Settings

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
PROBE_PATHS = frozenset({"/health", "/ready"})
_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[^:\[\]]+)(?::[0-9]*)?")


def host_name(host: str) -> str:
    """``host`` without its port, in lower case: ``[::1]:8000`` -> ``[::1]``; "" for a
    value that is not a name or address with an optional port (``[::1]x``, ``a:1:2``)."""
    match = _HOST.fullmatch(host.strip().lower())
    return match.group(1) if match else ""


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a keyless server answers a request with this ``Host`` value."""
    value = host.strip().lower()
    name = host_name(value)
    if "*" in allowed:
        return True
    return bool(name) and (name in LOOPBACK_HOSTS or name in allowed or value in allowed)


def register_host_check(app: Quart, settings: Settings) -> None:
    """With no API key set, refuse a ``Host`` that is not loopback or allowed (see the
    module docstring); with a key set, do nothing."""
    if settings.api_key is not None or settings.api_keys:
        return
    allowed = settings.allowed_hosts

    @app.before_request
    async def check_host() -> None:
        """Raises ApiError bad_request (400). Cancellation: nothing to undo, as none can
        land: no checkpoint."""
        if request.path in PROBE_PATHS:
            return
        host = request.headers.get("Host", "")
        if not host.strip() and "*" not in allowed:
            raise ApiError(
                ErrorType.BAD_REQUEST,
                "this server has no API key and answers only requests whose Host names "
                "it (localhost, 127.0.0.1, [::1] or STREAMSCOPE_ALLOWED_HOSTS); this one "
                "names none")
        if not host_allowed(host, allowed):
            raise ApiError(
                ErrorType.BAD_REQUEST,
                f"this server has no API key and answers only local Host names (localhost, "
                f"127.0.0.1, [::1]) and STREAMSCOPE_ALLOWED_HOSTS, not {host[:64]!r}")

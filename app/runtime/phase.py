"""Where the server is in its life, and the refusal each phase gives a new stream.

Theory of operation
-------------------
::

    NEW ──start()──> LOADING ──engine built, hub started──> READY
                        │                                     │
                        └── load failed ──> FAILED <── a step raised
    NEW, LOADING or READY ──drain()──> DRAINING ──stop(), hub stopped──> STOPPED
    FAILED ──stop()──> STOPPED

Only READY opens streams; every other phase answers a new one with a 503 whose type
says why (``refusal``). ``Runtime`` (``runtime.py``) moves the phase; this module only
names the phases and their refusals.
"""

from __future__ import annotations

import enum

from ..errors import ApiError, ErrorType

# The Retry-After of a refusal while the server drains or stops: a load balancer sends
# the retry to another replica at once; a lone server is gone or restarting by then.
SHUTDOWN_RETRY_AFTER_S = 1.0
# The Retry-After of a refusal while the model loads: a replica that has just (re)started
# answers before it can serve; a client that retries, through the balancer, gets another.
LOADING_RETRY_AFTER_S = 1.0


class Phase(enum.Enum):
    """Where the server is in its life (see the module docstring)."""

    NEW = "new"  # made; before_serving has not run; refusing
    LOADING = "loading"  # the model loads in a worker thread; refusing with not_ready
    READY = "ready"  # the engine is loaded and the hub runs; streams open
    FAILED = "failed"  # the load or a step raised; refusing with unavailable
    DRAINING = "draining"  # drain() began: refusing with shutdown; open streams finish
    STOPPED = "stopped"  # the hub stopped; the engine holds none of our requests


_REFUSALS = {
    Phase.NEW: (ErrorType.NOT_READY, "the server has not started"),
    Phase.LOADING: (ErrorType.NOT_READY, "the model is still loading"),
    Phase.FAILED: (ErrorType.UNAVAILABLE, "the engine failed; the server's log says why"),
    Phase.DRAINING: (ErrorType.SHUTDOWN, "the server is stopping"),
    Phase.STOPPED: (ErrorType.SHUTDOWN, "the server has stopped"),
}


def refusal(phase: Phase, failure: str | None) -> ApiError | None:
    """Why streams cannot open in ``phase``, or None: a fixed message a phase.

    ``failure`` (why it is FAILED: the exception, with a path or an address in it, maybe)
    is the log's and the operator's console's (``Runtime._fail``, ``streamscope serve``),
    never a client's: ``/health``, ``/ready`` and every refused request say only that the
    engine failed.
    """
    del failure  # see the docstring
    if phase is Phase.READY:
        return None
    error_type, message = _REFUSALS[phase]
    if error_type is ErrorType.SHUTDOWN:
        return ApiError(error_type, message, retry_after_s=SHUTDOWN_RETRY_AFTER_S)
    if error_type is ErrorType.NOT_READY:
        return ApiError(error_type, message, retry_after_s=LOADING_RETRY_AFTER_S)
    return ApiError(error_type, message)

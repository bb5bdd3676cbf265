"""Failover: a resumable stream taken over from a dead replica, rebuilt on this one.

With a shared resume store (``STREAMSCOPE_RESUME_STORE``), a resumable stream's owner
publishes a spec with its first event (``streams.resume.spec_of``: the request as the
engine got it, its prompt's token ids, and its seed) and holds an owner lease
(``STREAMSCOPE_OWNER_LEASE_S``). If the owner dies, a resume on another replica takes
the stream over (``streams.resume``: an atomic operation of the store) and calls
``Rebuilder``: it reads the token ids the logged ``token`` events carry
(``generated_ids``), opens the stream on this replica's engine continuing after them
(``Runtime.prepare(resume_from=)``: the tokens that follow are the uninterrupted run's),
and hands it to the registry, whose log numbers its events after the logged ones.
Knows the ``Runtime``, and ``streams.resume`` and the engine only at their roots.
"""

from __future__ import annotations

import json

from streams.resume import Adopt, generated_ids, policy_of, request_of

from ..errors import ApiError, ErrorType
from ..metrics import Metrics
from ..runtime import Runtime
from ..wire import ResumableEvents


class Rebuilder:
    """``streams.resume.Rebuild`` for this app: open a taken-over stream again (see the
    module docstring)."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self._runtime = runtime
        self._metrics = metrics

    async def __call__(self, request_id: str, spec: bytes,
                       events: list[tuple[int, bytes, bool]], adopt: Adopt) -> None:
        """Raises: ApiError 503 (not ready, stopping; or a spec this replica cannot
        read), or what ``Runtime.prepare`` and ``Runtime.open`` raise. Cancellation:
        before the open, nothing was submitted; the open and ``adopt`` have no
        checkpoint between."""
        try:
            parsed = json.loads(spec)
            request = request_of(request_id, parsed)
            policy = policy_of(parsed)
            tokens = generated_ids(events)
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiError(ErrorType.UNAVAILABLE,
                           f"cannot continue this stream here: {exc}") from None
        timer = self._metrics.start_request()
        try:
            prepared = await self._runtime.prepare(request, policy,
                                                   resume_from=tokens)
            stream = self._runtime.open(prepared)
            timer.submitted(stream.prompt_tokens)
            adopt(stream, ResumableEvents(request_id, stream.prompt_tokens), timer)
        except BaseException:
            timer.close()
            raise

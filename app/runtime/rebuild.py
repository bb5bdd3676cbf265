"""Failover: a resumable stream taken over from a dead replica, rebuilt on this one.

With a shared resume store (``STREAMSCOPE_RESUME_STORE``), a resumable stream's owner
publishes a spec with its first event (``streams.resume.spec_of``: the request as a
request body, with its seed) and holds the writer lease (``STREAMSCOPE_WRITER_LEASE_S``).
If the owner dies, a resume on another replica takes the stream over
(``streams.resume``: an atomic operation of the store) and calls ``Rebuilder``.

Nothing the store holds is trusted. ``streams.resume`` hands over the spec and events
only once their HMAC matched (``STREAMSCOPE_RESUME_SECRET``); the rebuilder then parses
the spec with ``parse_generate_body``, the very function that validates an HTTP body
(``max_new_tokens`` against the limit, the stop strings' count and length, the sampling
ranges, the prompt's length, the policy against the allow-list), and opens it through
``Runtime.prepare`` and ``Runtime.open`` as a route does: the prompt is encoded here
(no prompt token id comes from the store) and the engine checks the token budget. The
token ids the logged ``token`` events carry (``generated_ids``; authenticated with the
events) are what the stream continues after (``prepare(resume_from=)``: the tokens that
follow are the uninterrupted run's); the engine refuses any of them outside its
vocabulary (``engine.InvalidRequest``, as everything else it refuses at the submit: the
stream is refused, not run). A spec refused ends its reader's body with one
``error`` event ``unavailable`` (``refusal``) and counts in ``resume_spec_rejected``.
Knows the ``Runtime``, and ``streams.resume`` and the engine only at their roots; the
app's factory makes it the runtime's ``rebuild`` (``app/factory.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pydantic

import engine
from streams.resume import Adopt, StoreRejected, generated_ids, spec_parts

from ..errors import ErrorType
from ..key_shares import SlotObserver
from .runtime import Runtime

if TYPE_CHECKING:
    from ..metrics import Metrics, RequestTimer
from ..schemas import RequestLimits, parse_generate_body
from ..wire import ResumableEvents, event_without_id


class Rebuilder:
    """``streams.resume.Rebuild`` for this app: open a taken-over stream again (see the
    module docstring)."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self._runtime = runtime
        self._metrics = metrics
        self._limits = RequestLimits.from_settings(runtime.settings)

    async def __call__(self, request_id: str, spec: bytes,
                       events: list[tuple[int, bytes, bool]], adopt: Adopt) -> None:
        """Raises: StoreRejected (a spec an HTTP request would be refused for, or
        events that do not say which tokens were made), or what ``Runtime.prepare`` and
        ``Runtime.open`` raise. Cancellation: nothing to undo before the open, as nothing
        was submitted; then handed over: the open and ``adopt`` have no checkpoint
        between."""
        try:
            raw, namespace = spec_parts(spec)  # the key's namespace: its cached blocks
            body = parse_generate_body(raw, self._limits)
            tokens = generated_ids(events)
        except pydantic.ValidationError as exc:
            raise StoreRejected(f"the stored request of stream {request_id} is refused "
                                f"here: {_summary(exc)}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreRejected(f"the stored events of stream {request_id} say no tokens: "
                                f"{exc}") from None
        request = replace(body.generation_request(), request_id=request_id,
                          cache_namespace=namespace)
        if len(tokens) > request.max_new_tokens:
            raise StoreRejected(f"the stored events of stream {request_id} hold "
                                f"{len(tokens)} tokens, over its max_new_tokens")
        timer = self._metrics.start_request()
        watcher: RequestTimer | SlotObserver = timer  # closed by the registry once adopted
        try:
            prepared = await self._runtime.prepare(request, body.policy, resume_from=tokens)
            try:
                stream = self._runtime.open(prepared, rebuilt=True)
            except engine.InvalidRequest as exc:  # a token id outside the vocabulary, ...
                raise StoreRejected(f"the stored stream {request_id} is refused by the "
                                    f"engine here: {exc}") from None
            timer.submitted(stream.prompt_tokens, request_id, prepared.request.max_new_tokens)
            watcher = self._observer(request_id, timer)
            adopt(stream, ResumableEvents(request_id, stream.prompt_tokens), watcher)
        except BaseException:
            watcher.close()
            raise

    def _observer(self, request_id: str, timer: RequestTimer) -> RequestTimer | SlotObserver:
        """``timer``, holding a slot of the key that made the stream (its id says which;
        ``key_shares.py``): a rebuilt stream counts against its key as it did on the
        replica that died. Sync."""
        shares = self._runtime.shares
        slot = None if shares is None else shares.rebuilt_slot(request_id)
        return timer if slot is None else SlotObserver(timer, slot)

    def refusal(self, request_id: str, message: str) -> bytes:
        """The ``error`` event (no id) a reader gets for a stream whose stored spec or
        events are refused: ``unavailable``, with why (the store's bytes are not in it)."""
        return event_without_id(ErrorType.UNAVAILABLE, "this stream cannot be continued: "
                                f"{message}")


def _summary(exc: pydantic.ValidationError) -> str:
    """Which fields, and why, without their values (a prompt is no log line)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                     for e in exc.errors(include_input=False))[:500]


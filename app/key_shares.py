"""Fair shares between API keys: no key can lock the others out of a server-wide cap.

A server-wide cap (``max_waiting`` streams waiting for a first token,
``max_detached_streams``) used to be first come, first served: one key could fill it and
every other key was refused until its streams ended, and a busy key refilled it at once.
Here each key may hold only its share of each cap (``fair_share``), counted per key by
the app (the hub and the engine know no keys): refused past it with 429 ``key_limit``.

The rule, for a cap of C and n configured keys, when key k asks for one more:

- **A reserve of one for every other key that holds none**: k may take a place only if
  the places left free after it still hold one for each other key with none of this cap.
  So no key ever takes the whole of a cap while another has none, and a key holding
  none is refused only by the cap itself (never by this rule).
- **An equal share among the keys holding some**: while m other keys hold some, k may
  hold at most ``max(1, ceil(C / (m + 1)))``.
- **A lone key borrows the rest**: with no other key holding any, k may hold up to
  C less the reserve (C itself with one key: ``STREAMSCOPE_API_KEY`` alone uses the
  whole server). What it borrowed is not taken back (no stream is cut), but once
  another key holds some, k gets no new place above its equal share, so the cap comes
  back to the shares as k's streams end.

With more keys than places (C < n) each key holds at most one place, first come.

What counts: a key's streams *waiting* for their first token (of ``max_waiting``), and
its resumable streams *generating*, read or not (of ``max_detached_streams``: any of them
becomes detached the moment its reader leaves, so counting only the detached ones would
let a key fill the cap by dropping its readers). Streams rebuilt here by failover count
against the key that made them (the id says which, ``Credential.owns``), and so do their
slots of ``max_streams`` (``KeyUsage.take(force=True)``): a continuation is not refused
by a per-key rule, since it was admitted under the same rules on its first replica and a
refused ``EventSource`` does not retry.

The open-stream limit (``max_streams`` per key, else ``key_max_streams``, also for
``STREAMSCOPE_API_KEY``) is a plain per-key count (``KeyUsage``), taken before a
request's body is read (429 ``too_many_streams``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from engine import FinishEvent
from streams import StreamError, StreamItem, StreamState, TokenStream

from .api_keys import Credential, all_keys
from .errors import ApiError, ErrorType
from .settings import Settings

if TYPE_CHECKING:
    from .metrics import RequestTimer

# A key at its open-stream limit: a stream of its own must end first; most are short.
LIMIT_RETRY_AFTER_S = 1.0
_GENERATING = (StreamState.WAITING, StreamState.STREAMING)


def fair_share(cap: int, held: Mapping[str, int], name: str, keys: int) -> int:
    """The most of ``cap`` that key ``name`` may hold now, given what every key holds
    (``held``) and how many keys the server has (``keys``); see the module docstring.
    At least 1: a key holding none is refused only by the cap itself."""
    others_active = sum(1 for k, n in held.items() if k != name and n > 0)
    others_idle = max(0, keys - 1 - others_active)
    others_held = sum(n for k, n in held.items() if k != name)
    equal = max(1, math.ceil(cap / (others_active + 1))) if others_active else cap
    return max(1, min(equal, cap - others_idle - others_held))


class KeyUsage:
    """How many streams each key holds open now (its slots)."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def take(self, credential: Credential, *, force: bool = False) -> Slot:
        """A slot of ``credential``'s; ``force``: even past its limit (a rebuilt stream).
        Raises: ApiError 429 too_many_streams."""
        limit, held = credential.max_streams, self.open.get(credential.name, 0)
        if not force and limit is not None and held >= limit:
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


class KeyShares:
    """The server's keys, their slots, and the streams each has open, for the fair
    shares (see the module docstring). Sync throughout, never a checkpoint.

    Args:
        credentials: the server's keys (at least one).
        max_waiting, max_detached: the caps shared.
        waiting_retry_after_s, detached_retry_after_s: the Retry-After of each refusal.
    """

    def __init__(self, credentials: Sequence[Credential], *, max_waiting: int,
                 max_detached: int, waiting_retry_after_s: float,
                 detached_retry_after_s: float) -> None:
        self.credentials = tuple(credentials)
        self.usage = KeyUsage()
        self._caps = {"waiting": (max_waiting, waiting_retry_after_s),
                      "resumable": (max_detached, detached_retry_after_s)}
        # request id -> (key name, its stream, resumable); closed streams are pruned.
        self._open: dict[str, tuple[str, TokenStream, bool]] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyShares | None:
        """The shares of the settings' keys; None on a server without keys."""
        keys = all_keys(settings.api_key, settings.api_keys)
        if not keys:
            return None
        return cls([Credential(k, default_max_streams=settings.key_max_streams)
                    for k in keys],
                   max_waiting=settings.max_waiting,
                   max_detached=settings.max_detached_streams,
                   waiting_retry_after_s=settings.hub_settings().waiting_retry_after_s,
                   detached_retry_after_s=settings.attach_timeout_s)

    def owner(self, request_id: str) -> Credential | None:
        """The key that made ``request_id`` (``Credential.owns``), or None."""
        return next((c for c in self.credentials if c.owns(request_id)), None)

    def held(self) -> dict[str, dict[str, int]]:
        """Per cap, per key: its streams waiting for a first token (``"waiting"``) and
        its resumable streams generating (``"resumable"``). One pass, which also forgets
        the closed streams."""
        waiting: dict[str, int] = {}
        resumable: dict[str, int] = {}
        closed = []
        for request_id, (name, stream, is_resumable) in self._open.items():
            state = stream.state
            if state is StreamState.CLOSED:
                closed.append(request_id)
                continue
            if state is StreamState.WAITING:
                waiting[name] = waiting.get(name, 0) + 1
            if is_resumable and state in _GENERATING:
                resumable[name] = resumable.get(name, 0) + 1
        for request_id in closed:
            del self._open[request_id]
        return {"waiting": waiting, "resumable": resumable}

    def check(self, credential: Credential, *, resumable: bool) -> None:
        """Refuse a stream of ``credential``'s past its fair share of the waiting
        streams, or (``resumable``) of the resumable ones. Call it right before the
        open (``opened``).

        Raises: ApiError 429 key_limit (``Retry-After``).
        """
        counts = self.held()
        for what in ("waiting", "resumable") if resumable else ("waiting",):
            cap, retry_after_s = self._caps[what]
            held = counts[what]
            share = fair_share(cap, held, credential.name, len(self.credentials))
            mine = held.get(credential.name, 0)
            if what == "waiting" and sum(held.values()) >= cap:
                continue  # the server is full: the hub's too_many_waiting answers
            if share < cap and mine >= share:  # at the whole cap: the cap's own refusal
                others = sum(1 for k, n in held.items() if k != credential.name and n)
                raise ApiError(
                    ErrorType.KEY_LIMIT,
                    f"the API key {credential.name!r} holds {mine} of the server's {cap} "
                    f"{_WHAT[what]}, its fair share now ({others} other keys hold some "
                    f"of it, and a place is kept for each key holding none); try again "
                    f"when one of its streams ends",
                    retry_after_s=retry_after_s)

    def opened(self, credential: Credential, stream: TokenStream, *,
               resumable: bool) -> None:
        """Count ``stream`` (just opened) against ``credential`` until it closes."""
        self._open[stream.request_id] = (credential.name, stream, resumable)

    def rebuilt_slot(self, request_id: str) -> Slot | None:
        """The slot of a stream rebuilt here by failover, taken for its key even past
        its limit (see the module docstring); None for an id no key made."""
        credential = self.owner(request_id)
        return None if credential is None else self.usage.take(credential, force=True)


_WHAT = {"waiting": "streams waiting for a first token (STREAMSCOPE_MAX_WAITING)",
         "resumable": "resumable streams that may generate with no reader "
                      "(STREAMSCOPE_MAX_DETACHED_STREAMS)"}


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

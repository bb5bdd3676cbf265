"""The scope's plain data: what one frame of the live view says (``scope_feed.py``).

Frozen values built in the Trio thread at a step boundary and read by each watcher's
encoder (``app.wire.scope_events``): rows of streams, the step timeline, the block
pool and the moments that teach. No text unless the operator turned it on; request
ids are shortened by the encoder.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScopeRow:
    """One stream as the scope shows it.

    ``state``: ``waiting``, ``prefilling``, ``running``, ``paused``, ``detached`` (a
    resumable stream generating with no reader attached), or, once over,
    the end: ``eos``, ``length``, ``stop`` (the engine finished it), ``cancelled`` (its
    client left: closed while the engine held it), ``dropped`` (a slow reader the policy
    dropped), ``error``, ``deadline``, ``shutdown``. ``released``: the engine's finish
    arrived, so its blocks are back in the pool.
    """

    request_id: str
    key: str | None  # the API key's name (None: a server without keys)
    state: str
    tokens: int  # generated so far (queued, written or discarded)
    queued: int  # items waiting for its writer
    queue_limit: int  # its policy's limit
    released: bool = False
    text: str | None = None  # the latest text, only with the operator's setting on
    band: int = 0  # its priority band (lower is sooner, engine.priority)

    @property
    def is_over(self) -> bool:
        return self.state not in LIVE_STATES


LIVE_STATES = frozenset({"waiting", "prefilling", "running", "paused", "detached"})


@dataclass(frozen=True, slots=True)
class ScopeStep:
    """One engine step: its number, its time, rows decoded, prompt positions prefilled."""

    step: int
    ms: float | None
    decoded: int
    prefilled: int
    target_ms: float | None  # the step-time target, if one is set


@dataclass(frozen=True, slots=True)
class ScopePool:
    """The KV block pool at a step boundary. ``in_use`` are referenced by sequences, of
    which ``shared`` by more than one; ``cached`` hold a committed prefix (in use or
    evictable: an evictable one counts as free too)."""

    total: int
    free: int
    in_use: int
    cached: int
    shared: int


@dataclass(frozen=True, slots=True)
class ScopeMoment:
    """Something worth a second look, with who paid for it.

    ``kind``: ``disconnect`` (``steps`` and ``ms`` from the close to its blocks'
    release), ``pause`` / ``resume`` (a slow reader's sequence left / rejoined the
    decode batch), ``drop`` (a slow reader cancelled), ``preemption`` (sequences whose
    blocks were taken back; ``count`` of them) and ``recompute`` (``count`` positions
    prefilled again).
    """

    kind: str
    request_id: str | None
    key: str | None
    detail: str
    steps: int | None = None
    ms: float | None = None
    count: int | None = None


@dataclass(frozen=True, slots=True)
class ScopeFrame:
    """What changed at one step boundary, or (``snapshot``) all there is to know now.

    ``rows``: every open stream, then the ones that ended since the last frame (a
    snapshot: the recently ended too). ``missed``: frames this watcher's full queue
    dropped before this snapshot (0 otherwise).
    """

    event_id: str
    time_s: float  # the server's monotonic time (Trio's clock)
    snapshot: bool
    rows: tuple[ScopeRow, ...]
    steps: tuple[ScopeStep, ...]
    pool: ScopePool | None
    moments: tuple[ScopeMoment, ...]
    missed: int = 0

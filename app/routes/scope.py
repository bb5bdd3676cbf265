"""The scope: a live page of the batch, the cache and every stream's fate.

* ``GET /scope`` and ``GET /scope.js``: the page (``static/scope.html``, ``scope.js``),
  static, no build step; open like ``/`` (``auth.OPEN_PATHS``): it holds no data.
* ``GET /scope/token``: with a key, the feed's URL with a read token of the feed
  (``auth.scope_query``: EventSource cannot send the key), and who the page sees as.
* ``GET /scope/events``: the feed, one SSE stream of frames (``app.wire.ScopeEvents``)
  read from the hub's ``ScopeFeed`` through the one SSE body (``body.py``).

Who sees what: without API keys, everyone sees everything (like ``/stats``). With keys,
the feed needs one (the bearer token, or the read token ``/scope/token`` made with it):
a key named in ``scope_operator_keys`` sees every stream's row; any other key sees its
own streams' rows (a stream's key is the one that owns its id: ``auth.owned_request``)
and the server's steps and block pool, which hold no request. No prompt or text is in
it unless ``scope_show_text`` is on.

A watcher is a stream like any other: its queue is bounded by the hub's policy, it
misses frames (and gets a snapshot) when behind, and a dropping policy drops it with
``slow_client``; the engine never waits for it (``streams/scope_watcher.py``). A page
that reconnects sends ``Last-Event-ID`` (or ``?last_event_id=``) and gets what it
missed, or a snapshot. A ``Last-Event-ID`` that names no frame of this server's life
(another life's, malformed, or thousands of digits) is ignored, as an SSE client would
ignore a bad id: the page starts again from a snapshot (never a 4xx, which an
EventSource would not retry).

A GET takes no stream slot, yet each watcher costs every step a write of each frame (its
bytes are encoded once per view and shared: ``app.wire.SharedFrames``), so watchers are
capped (``check_watchers``): ``scope_key_watchers`` per key (``scope_operator_watchers``
for an operator key) and ``scope_max_watchers`` in all; past a cap, 429
``too_many_watchers`` with ``Retry-After``, before the stream (docs/security.md, What a
watcher costs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quart import Blueprint, Response, request

from streams.resume import Holding

from ..api_keys import Credential, all_keys
from ..auth import SCOPE_EVENTS_PATH, key_name, scope_query
from ..edge.connection import close_with_connection
from ..errors import ApiError, ErrorType
from ..runtime import Runtime
from ..settings import Settings
from ..wire import ScopeEvents, SharedFrames
from .body import EventStreamBody
from .page import CACHE_CONTROL, CONTENT_SECURITY_POLICY, STATIC_DIR
from .serving import json_response, sse_response

if TYPE_CHECKING:
    from streams import ScopeFeed

PAGE_PATH = "/scope"
SCRIPT_PATH = "/scope.js"
TOKEN_PATH = "/scope/token"
# A page closed gives its watcher back at once; one left open holds it until it is.
WATCHERS_RETRY_AFTER_S = 5.0


def check_watchers(feed: ScopeFeed, settings: Settings, name: str | None) -> None:
    """Refuse a new watcher of key ``name`` (None: a server without keys) past its
    key's cap or the server's. Sync: call it right before the subscribe.

    Raises: ApiError 429 too_many_watchers (``Retry-After``).
    """
    if feed.watchers >= settings.scope_max_watchers:
        raise ApiError(ErrorType.TOO_MANY_WATCHERS,
                       f"{settings.scope_max_watchers} scope watchers are open, this "
                       f"server's limit (STREAMSCOPE_SCOPE_MAX_WATCHERS); close a page "
                       f"or try again later", retry_after_s=WATCHERS_RETRY_AFTER_S)
    if name is None:
        return
    operator = name in settings.scope_operator_keys
    limit = settings.scope_operator_watchers if operator else settings.scope_key_watchers
    held = feed.watching(name)
    if held >= limit:
        variable = "OPERATOR_WATCHERS" if operator else "KEY_WATCHERS"
        raise ApiError(ErrorType.TOO_MANY_WATCHERS,
                       f"the API key {name!r} holds {held} scope watchers, its limit "
                       f"(STREAMSCOPE_SCOPE_{variable}); close a page or try again later",
                       retry_after_s=WATCHERS_RETRY_AFTER_S)


def make_scope_blueprint(runtime: Runtime) -> Blueprint:
    """The scope's four routes (module docstring)."""
    bp = Blueprint("scope", __name__)
    settings = runtime.settings
    credentials = [Credential(k) for k in all_keys(settings.api_key, settings.api_keys)]
    shared = SharedFrames()  # every watcher's frames, encoded once per view
    page = (STATIC_DIR / "scope.html").read_bytes()
    script = (STATIC_DIR / "scope.js").read_bytes()
    headers = {"Cache-Control": CACHE_CONTROL, "Content-Security-Policy":
               CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff"}

    def key_of(request_id: str) -> str | None:
        """The name of the key that owns ``request_id`` (None: no key, or none does)."""
        return next((c.name for c in credentials if c.owns(request_id)), None)

    def viewer() -> str | None:
        """The key whose rows this request sees; None: every row (ScopeEvents.ALL)."""
        name = key_name()
        return None if name is None or name in settings.scope_operator_keys else name

    @bp.get(PAGE_PATH)
    async def scope_page() -> Response:
        """The page. Cancellation: nothing to undo, as none can land: no checkpoint."""
        return Response(page, content_type="text/html; charset=utf-8", headers=headers)

    @bp.get(SCRIPT_PATH)
    async def scope_script() -> Response:
        """Its script. Cancellation: nothing to undo, as none can land: no checkpoint."""
        return Response(script, content_type="text/javascript; charset=utf-8",
                        headers=headers)

    @bp.get(TOKEN_PATH)
    async def scope_token() -> Response:
        """The feed's URL for EventSource, and whose rows it shows. Cancellation:
        nothing to undo, as none can land: no checkpoint."""
        name = viewer()
        return json_response({"events_url": SCOPE_EVENTS_PATH + scope_query(),
                              "key": key_name(), "sees_all": name is None})

    @bp.get(SCOPE_EVENTS_PATH)
    async def scope_events() -> Response:
        """Subscribe a watcher and answer its frames as ``text/event-stream``.

        Raises: ApiError 503 unavailable before the hub runs; 429 too_many_watchers.
        Cancellation: closed by its owner: the watcher goes to the connection
        (``close_with_connection``) as it is subscribed, with no checkpoint before the
        body, whose ``__aexit__`` (or the connection's backstop) closes it.
        """
        hub = runtime.hub
        if hub is None:
            raise ApiError(ErrorType.UNAVAILABLE, "the model is not loaded yet")
        feed = hub.scope
        name = key_name()
        check_watchers(feed, settings, name)
        feed.key_of = key_of
        registry = runtime.resumption
        if registry is not None:
            feed.detached = lambda i: registry.holding(i) is Holding.DETACHED
        feed.show_text = settings.scope_show_text
        last = request.headers.get("Last-Event-ID") or request.args.get("last_event_id")
        watcher = feed.subscribe(last, tag=name)
        close_with_connection(request.scope, watcher)
        body = EventStreamBody(watcher, ScopeEvents(viewer(), shared),
                               keepalive_s=settings.keepalive_s, keepalives=runtime.keepalives)
        return sse_response(body, None)

    return bp

"""The browser page: ``GET /`` (``static/index.html``) and ``GET /page.js``.

One static page, no build step, no framework, nothing loaded from elsewhere: a prompt,
sampling settings, Start and Stop, the text as it streams, TTFT and tokens/s, a status
line. It speaks the resumable wire contract (``resumable.py``): ``POST /v1/requests``,
then ``EventSource`` on the stream's URL, which reconnects by itself with
``Last-Event-ID``; Stop is ``DELETE /v1/requests/<id>``. How the page behaves is told at
the top of ``static/page.js``; how it gets past an API key, in ``app/auth.py``.

Both files are read once, when the blueprint is made, and served from memory; the page
shows no request data, so both paths are open (``auth.OPEN_PATHS``).
"""

from __future__ import annotations

from pathlib import Path

from quart import Blueprint, Response

STATIC_DIR = Path(__file__).parent.parent / "static"  # app/static
PAGE_PATH = "/"
SCRIPT_PATH = "/page.js"
# The files may change with the server's version, never while it runs: a browser may
# keep them briefly, and must ask again after that.
CACHE_CONTROL = "no-cache"
# Nothing but this origin: no inline script, no frames, no other sources.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "frame-ancestors 'none'"
)


def make_page_blueprint() -> Blueprint:
    """``GET /`` and ``GET /page.js``."""
    bp = Blueprint("page", __name__)
    page = (STATIC_DIR / "index.html").read_bytes()
    script = (STATIC_DIR / "page.js").read_bytes()
    headers = {
        "Cache-Control": CACHE_CONTROL,
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
    }

    @bp.get(PAGE_PATH)
    async def index() -> Response:
        """The page. Cancellation: nothing to undo, as none can land: no checkpoint."""
        return Response(page, content_type="text/html; charset=utf-8", headers=headers)

    @bp.get(SCRIPT_PATH)
    async def page_script() -> Response:
        """Its script. Cancellation: nothing to undo, as none can land: no checkpoint."""
        return Response(script, content_type="text/javascript; charset=utf-8", headers=headers)

    return bp

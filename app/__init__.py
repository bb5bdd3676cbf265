"""The HTTP layer: ``hypercorn -k trio app:app`` serves this ``app``.

Settings come from ``STREAMSCOPE_*`` environment variables (``app/settings.py``); the
model loads when the server starts, not at import.
"""

from . import http_fixes

# Before any server starts: hypercorn 0.18's trio worker must build our TCPServer
# (``http_fixes.py``: Connection: close, HTTP/1.0, keep-alive after an unread body).
http_fixes.install()

from .factory import create_app  # noqa: E402

app = create_app(drain_on_sigterm=True)  # a SIGTERM drains first (``drain.py``)

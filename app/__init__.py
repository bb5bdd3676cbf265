"""The HTTP layer: ``hypercorn -k trio app:app`` serves this ``app``.

Settings come from ``STREAMSCOPE_*`` environment variables (``app/settings.py``); the
model loads when the server starts, not at import.
"""

from .factory import create_app

app = create_app(drain_on_sigterm=True)  # a SIGTERM drains first (``drain.py``)

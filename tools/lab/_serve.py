"""``python -m tools.lab._serve serve [--bind ...]``: ``streamscope serve`` (``app/cli.py``)
serving the lab's app (``_app.py``), with its ``STREAMSCOPE_LAB_*`` devices.

The lab's variables are read, then taken out of the environment before ``app`` is
imported, as in ``_asgi.py``.
"""

import os
import sys

from tools.lab._settings import take_lab_settings

lab_settings = take_lab_settings(os.environ)

from app.cli import main  # noqa: E402
from tools.lab._app import create_lab_app  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(make_app=lambda settings: create_lab_app(settings, lab_settings)))

"""``hypercorn -k trio tools.lab._asgi:app``: the lab's server (``_app.py``), which
``python -m tools.lab`` starts.

The ``STREAMSCOPE_LAB_*`` variables are read, then taken out of this process's
environment BEFORE ``app`` is imported: importing it reads the service's settings, which
refuse every ``STREAMSCOPE_`` name they do not know.
"""

import os

from tools.lab._settings import take_lab_settings

lab_settings = take_lab_settings(os.environ)

from tools.lab._app import create_lab_app  # noqa: E402

app = create_lab_app(lab=lab_settings, drain_on_sigterm=True)  # a SIGTERM drains first

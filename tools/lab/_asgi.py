"""``hypercorn -k trio tools.lab._asgi:app``: the lab's server (``_app.py``), which
``python -m tools.lab`` starts.

The service reads its settings from the environment without the ``STREAMSCOPE_LAB_*``
variables (it refuses names it does not know); the lab reads those.
"""

import os

from app.settings import Settings
from tools.lab._app import create_lab_app
from tools.lab._settings import split_lab_environ

lab_settings, service_environ = split_lab_environ(os.environ)
app = create_lab_app(Settings.from_env(service_environ), lab_settings,
                     drain_on_sigterm=True)  # a SIGTERM drains first

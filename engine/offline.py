"""No model hub at run time, ever: the switches that keep transformers local.

huggingface_hub and transformers read these variables once, when they are first
imported, so they must be set before that import, and by whoever imports them: the
engine's loading path (``model.py``, ``attention.py``) calls ``hub_offline()`` right
before its own imports of transformers. Importing the engine package sets nothing:
a process that never loads a model keeps its environment as it was. Every load also
passes ``local_files_only=True``; the switches are what keeps a path we did not think
of (a tokenizer's or a config's own download) from reaching the network.
"""

from __future__ import annotations

import os

OFFLINE_SWITCHES = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def hub_offline() -> None:
    """Set the offline switches (idempotent). Call before importing transformers."""
    os.environ.update(OFFLINE_SWITCHES)

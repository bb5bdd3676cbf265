"""Bounds on a JSON schema's numbers, so that a small model cannot run away in one.

With ``{"type": "integer"}`` and nothing else, every digit keeps the number valid, and a
small model that has started one often never stops: SmolLM2-135M, asked for cities and
their populations under a strict schema, wrote ``8581222232333333...`` until its token
budget ran out (issue 45). llama.cpp's JSON-schema grammar bounds what the schema leaves
open: an integer's part has at most 16 digits, a fraction at most 16, an exponent its
own. ``bounded`` does the same before the schema is compiled, in terms llguidance
compiles into its digit-bounded lexer (checked with its 1.9 release, 2026-12):

* ``integer`` without ``minimum`` (or ``exclusiveMinimum``) gets ``minimum:
  -(10**16 - 1)``; without a maximum, ``maximum: 10**16 - 1``: at most 16 digits. The
  library turns an integer range into a regular expression over digit strings, so a
  17th digit is masked out, not refused after the fact;
* ``number`` gets the same range (llguidance writes no exponent for a number with a
  range, so none can run away either) and, without a ``multipleOf`` of its own,
  ``multipleOf: 1e-10``: at most ``FRACTION_DIGITS`` digits after the point (the
  library takes a decimal ``multipleOf`` as its digits; it refuses 1e-11 and finer
  as too many digits, hence 10 rather than llama.cpp's 16).

The schema's own bounds win: a side it bounds is left as it is, and a default bound is
not added where it would contradict the other side (a ``minimum`` above 10**16), nor
to a schema with an ``enum`` or ``const`` (its values are bounded already, and may be
larger).
Only numbers are touched: an answer that met the schema before meets it now unless it
held a number longer than these bounds, which is what they are for. Values that are
data, not schemas (``const``, ``enum``, ``default``, ``examples``) are never walked.

Pure: JSON in, JSON out, a new object (the caller's is not changed).
"""

from __future__ import annotations

from typing import Any

INTEGER_DIGITS = 16
"""The most digits of an integer, or of a number's integer part (llama.cpp's)."""
FRACTION_DIGITS = 10
"""The most digits after a number's decimal point (llguidance's finest ``multipleOf``)."""
LARGEST = 10**INTEGER_DIGITS - 1
STEP = float(f"1e-{FRACTION_DIGITS}")

# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems", "items")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded(schema: Any) -> Any:
    """``schema`` with default bounds on its integers and numbers (the module docstring);
    anything that is not a schema object (``true``, a list at the top) is returned as is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = bounded(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [bounded(item) for item in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded(item) for name, item in out[key].items()}
    kinds = _types(out.get("type"))
    if "enum" in out or "const" in out:  # its values are all it allows: bounded already
        return out
    if "integer" in kinds or "number" in kinds:
        _bound_range(out)
    if "number" in kinds and "multipleOf" not in out:
        out["multipleOf"] = STEP
    return out


def _types(value: Any) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {kind for kind in value if isinstance(kind, str)}
    return set()


def _bound_range(schema: dict[str, Any]) -> None:
    """Add the default minimum and maximum where the schema bounds neither way."""
    low = _number(schema.get("minimum"), schema.get("exclusiveMinimum"))
    high = _number(schema.get("maximum"), schema.get("exclusiveMaximum"))
    if low is None and (high is None or high > -LARGEST):
        schema["minimum"] = -LARGEST
    if high is None and (low is None or low < LARGEST):
        schema["maximum"] = LARGEST


def _number(*values: Any) -> float | None:
    """The first of ``values`` that is a JSON number (a bool is not), or None."""
    for value in values:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None

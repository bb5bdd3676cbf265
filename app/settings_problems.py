"""How ``settings.py`` reports a pydantic ``ValidationError``: one line per problem, in
the words of a person setting an environment variable, never a secret's value."""

from __future__ import annotations

from collections.abc import Callable, Collection

import pydantic

# What a pydantic error type means, said as the old hand-made parsers said it. The unit
# comes from the field's name (_s: seconds, _ms: milliseconds).
_PHRASES = {
    "int_parsing": "expected a whole number",
    "int_from_float": "expected a whole number",
    "int_type": "expected a whole number",
    "float_parsing": "expected a {unit}",
    "float_type": "expected a {unit}",
    "finite_number": "expected a finite {unit}",
    "greater_than_equal": "expected a whole number >= {ge}",
    "greater_than": "expected a finite {unit} > {gt:g}",
    "enum": "expected one of {expected}",
    "literal_error": "expected one of {expected}",
    "frozen_set_type": "expected a comma-separated list",
}


def problems(exc: pydantic.ValidationError, *, env_name: Callable[[str], str],
             secrets: Collection[str]) -> list[str]:
    """One line per error: ``NAME='raw': expected ...`` (the environment's text) or
    ``NAME=value: expected ...`` (in code); never the value of a field in ``secrets``;
    a check across fields as its own message."""
    found = []
    for error in exc.errors():
        if not error["loc"]:  # _consistent: the message names its variables
            found.append(error["msg"].removeprefix("Value error, "))
            continue
        field = str(error["loc"][0])
        name = env_name(field)
        unit = ("number of seconds" if field.endswith("_s")
                else "number of milliseconds" if field.endswith("_ms") else "number")
        phrase = _PHRASES.get(error["type"])
        message = (phrase.format(unit=unit, **error.get("ctx", {})) if phrase
                   else error["msg"].removeprefix("Value error, "))
        if field in secrets:
            found.append(f"{name}: {message}")
        else:
            found.append(f"{name}={error.get('input')!r}: {message}")
    return list(dict.fromkeys(found))  # a union type reports a value once per member

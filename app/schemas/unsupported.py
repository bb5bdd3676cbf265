"""The OpenAI fields this server does not implement, and the check that refuses them.

A client (the SDK, LangChain, ...) often sends such a field at the value that asks for
nothing (``best_of: 1``, ``echo: false``, ``min_tokens: 0``, null); that is accepted,
so ordinary clients work. Any other value is refused with a 400 whose ``param`` names
the field, since silently ignoring it would return something the client did not ask for.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

# Fields we do not implement, with the values that ask for nothing (null is always
# neutral). Per OpenAI's API reference (and vLLM's extensions where named).
COMMON_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "min_tokens": (0,),  # vLLM; the engine has no minimum length
    "best_of": (1,),
}
COMPLETIONS_UNSUPPORTED = {
    **COMMON_UNSUPPORTED,
    "echo": (False,),
    "suffix": ("",),
}
CHAT_UNSUPPORTED = {
    **COMMON_UNSUPPORTED,
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "store": (False,),
    "moderation": (),  # no moderation model runs here: refused, never skipped
}


def is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    """Whether ``value`` asks for nothing: null, or equal to a neutral value (booleans
    are not numbers here: ``false`` is not ``0``)."""
    if value is None:
        return True
    return any(
        value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral
    )


def neutral_validator(names: list[str]) -> Any:
    """A field validator refusing a non-neutral value of the model's ``UNSUPPORTED``
    (a class variable: each body has its own table)."""

    def check(cls: Any, value: object, info: ValidationInfo) -> object:
        assert info.field_name is not None
        neutral = cls.UNSUPPORTED[info.field_name]
        if not is_neutral(value, neutral):
            shown = ", ".join(json.dumps(n) for n in (None, *neutral))
            raise PydanticCustomError(
                "unsupported",
                "this server does not support this field; it accepts only {shown}",
                {"shown": shown},
            )
        return value

    return field_validator(*names)(classmethod(check))  # type: ignore[arg-type]

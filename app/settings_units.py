"""How a setting's amount of memory is written: a share, or bytes with a unit.

Apart from ``settings.py`` so that the settings model holds fields and their checks, and
this parsing has one place (``STREAMSCOPE_CACHE_MEMORY``).
"""

from __future__ import annotations

_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30}


def memory_amount(value: object) -> float | int:
    """A share of memory (``0.1``, with a point) or bytes (``2147483648``, ``512MiB``).

    Raises:
        ValueError: anything else (pydantic reports it under the setting's name).
    """
    if isinstance(value, str):
        number = value.strip().rstrip("BbKkMmGgIi")
        unit = value.strip()[len(number):].lower()
        try:
            if "." in number and not unit:
                value = float(number)
            elif unit in _MEMORY_UNITS:
                value = int(float(number) * _MEMORY_UNITS[unit])
        except ValueError:
            pass
    if isinstance(value, bool) or not (
        (isinstance(value, float) and 0 < value <= 1)
        or (isinstance(value, int) and value >= 1)
    ):
        raise ValueError("expected a share of memory in (0, 1] such as 0.1, or bytes such "
                         "as 2147483648, 512MiB or 2GiB")
    return value

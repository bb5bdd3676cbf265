"""The priority bands' settings: each API key's highest band and the gateway's objectives.

The operator's part of ``app/priority_bands.py`` (which says what a band is and how a
request's fields map onto one), apart from the rest of the service's settings
(``settings.py``, whose ``Settings`` extends this class, after the engine's). That every
name in ``priority_ceilings`` is one of the server's keys is checked there, with the keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import field_validator
from pydantic_settings import NoDecode

from .priority_bands import DEFAULT_BAND, Priority, check_bands
from .settings_engine import EngineSettings
from .settings_env import setting as _setting
from .settings_json import json_setting


class BandSettings(EngineSettings):
    """The engine's settings, then the bands' (see the module docstring). The mappings
    are held as sorted (name, band) pairs, so that the settings stay hashable."""

    # -- priority bands (issue 48; app/priority_bands.py) --
    priority_ceiling: Priority = _setting(DEFAULT_BAND,
        "the highest band (a priority from -10 to 10, lower is sooner) a request is "
        "served in, for every API key not in priority_ceilings and on a server without "
        "keys: a request asking higher (its `priority`, `service_tier: priority`) is "
        "served at this band, not refused")
    priority_ceilings: Annotated[tuple[tuple[str, int], ...], NoDecode] = _setting((),
        "API keys' own highest bands, a JSON object of key names (`default` for "
        'STREAMSCOPE_API_KEY) to bands, `{"interactive": -5}`; a key not named gets '
        "priority_ceiling", shown="(none)")
    inference_objectives: Annotated[tuple[tuple[str, int], ...], NoDecode] = _setting((),
        "the gateway's objectives: a JSON object of names to bands, `{\"critical\": -5, "
        "\"batch\": 8}`; a request naming one in its x-gateway-inference-objective "
        "header, and neither priority nor service_tier in its body, asks for that band "
        "(an unknown name: the default band, 0)", shown="(none)")

    @field_validator("priority_ceilings", "inference_objectives", mode="before")
    @classmethod
    def _bands(cls, value: object) -> tuple[tuple[str, int], ...]:
        """JSON text (or, in code, a mapping or pairs), held as sorted pairs: the
        settings stay hashable."""
        value = json_setting(value, "a JSON object of names to bands")
        if isinstance(value, tuple | list) and all(isinstance(p, tuple) for p in value):
            value = dict(value)
        if not isinstance(value, Mapping):
            raise ValueError("expected a JSON object of names to bands")
        return tuple(sorted(check_bands("the entry", value).items()))

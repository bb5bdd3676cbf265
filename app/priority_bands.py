"""Priority bands as the APIs name them: the one place that says how a request's
``priority``, ``service_tier`` and gateway header become the band it is served in, how a
key's ceiling bounds it, and what tier the answer says served it (issue 48).

A band is the engine's ``priority`` (``engine.priority``: vLLM's field, lower is sooner,
strict between bands). What a request asks for, in order:

1. ``priority`` (native, OpenAI chat and completions, Anthropic Messages, Responses): an
   integer from ``HIGHEST_BAND`` to ``LOWEST_BAND`` (else 4xx naming the field);
2. else ``service_tier`` (``TIER_BANDS``): OpenAI's ``priority`` (and ``fast``, which
   OpenAI serves as ``priority``) ask for the highest band there is, which the key's
   ceiling then lowers to the highest band *allowed*; ``default`` and ``auto`` the default
   band; ``flex`` ``FLEX_BAND``; ``scale`` is accepted and served as ``default``:
   OpenAI's Scale Tier is capacity a project buys ahead, of which this server reserves
   none, and OpenAI itself serves ``scale`` from a project without it at ``default``
   (refusing it would break a client that names it; raising it to ``priority`` would give
   every client the operator's top band for the asking). Anthropic's ``auto`` and
   ``standard_only`` both ask for the default band: ``auto`` means priority capacity
   *where the organisation has it*, which here is a key's ceiling, and a ceiling is what a
   key may ask for, not what it gets unasked;
3. else the gateway's ``x-gateway-inference-objective`` header, an objective's name that
   the operator's ``STREAMSCOPE_INFERENCE_OBJECTIVES`` maps to a band (an unknown name,
   as the Gateway API Inference Extension treats one, asks for the default band);
4. else ``DEFAULT_BAND``.

The key's ceiling (``STREAMSCOPE_PRIORITY_CEILINGS`` by key name, else
``STREAMSCOPE_PRIORITY_CEILING``, which also bounds a server without keys) is the highest
band it may be served in: a request asking above it is served at it, not refused. The
answer says which tier served it, from the served band (``openai_tier``,
``anthropic_tier``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field

# The bands a request, a ceiling or an objective may name; lower is sooner.
HIGHEST_BAND = -10
LOWEST_BAND = 10
DEFAULT_BAND = 0
FLEX_BAND = 5  # a low band, with room below it for an operator's batch objectives

# A request's ``priority`` field, on every API.
Priority = Annotated[int, Field(ge=HIGHEST_BAND, le=LOWEST_BAND)]
OpenAITier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
AnthropicTier = Literal["auto", "standard_only"]

TIER_BANDS: Mapping[str, int] = {
    "priority": HIGHEST_BAND,  # the highest the key's ceiling allows
    "fast": HIGHEST_BAND,  # OpenAI's name for priority processing
    "default": DEFAULT_BAND,
    "auto": DEFAULT_BAND,
    "scale": DEFAULT_BAND,  # no capacity reserved here (the module docstring)
    "flex": FLEX_BAND,
    "standard_only": DEFAULT_BAND,  # Anthropic's
}

# The gateway's header naming the request's InferenceObjective (Gateway API Inference
# Extension, llm-d).
OBJECTIVE_HEADER = "x-gateway-inference-objective"


def asked_band(priority: int | None, service_tier: str | None) -> int | None:
    """The band a body asks for: its ``priority``, else its ``service_tier``'s; None
    when it names neither (then the gateway's objective, or the default)."""
    if priority is not None:
        return priority
    return None if service_tier is None else TIER_BANDS[service_tier]


def openai_tier(band: int) -> Literal["priority", "default", "flex"]:
    """The ``service_tier`` an OpenAI answer says served a request of ``band``."""
    return "priority" if band < DEFAULT_BAND else "default" if band == DEFAULT_BAND \
        else "flex"


def anthropic_tier(band: int) -> Literal["priority", "standard", "batch"]:
    """The ``usage.service_tier`` an Anthropic answer says served a request of
    ``band`` (Anthropic's words: below standard is ``batch``)."""
    return "priority" if band < DEFAULT_BAND else "standard" if band == DEFAULT_BAND \
        else "batch"


@dataclass(frozen=True, slots=True)
class BandRules:
    """The operator's part: each key's ceiling and the gateway's objectives."""

    default_ceiling: int = DEFAULT_BAND
    ceilings: Mapping[str, int] = field(default_factory=dict)  # by key name
    objectives: Mapping[str, int] = field(default_factory=dict)  # by objective name

    @classmethod
    def of(cls, default_ceiling: int, ceilings: Iterable[tuple[str, int]],
           objectives: Iterable[tuple[str, int]]) -> BandRules:
        """From the settings' ``priority_ceiling``, ``priority_ceilings`` and
        ``inference_objectives``."""
        return cls(default_ceiling, dict(ceilings), dict(objectives))

    def ceiling(self, key: str | None) -> int:
        """The highest band ``key`` (None: a server without keys) may be served in."""
        if key is None:
            return self.default_ceiling
        return self.ceilings.get(key, self.default_ceiling)

    def served(self, asked: int | None, objective: str | None, key: str | None) -> int:
        """The band a request is served in: what it asked (else its objective's band,
        else the default), lowered to its key's ceiling (the module docstring)."""
        if asked is None:
            asked = self.objectives.get(objective or "", DEFAULT_BAND)
        return max(asked, self.ceiling(key))


def check_bands(what: str, bands: Mapping[str, int]) -> dict[str, int]:
    """``bands`` (a JSON object of names to bands, as a setting holds it), checked.

    Raises: ValueError naming ``what`` and the entry that is not a band."""
    checked = {}
    for name, band in bands.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what}: expected non-empty names")
        if isinstance(band, bool) or not isinstance(band, int) \
                or not HIGHEST_BAND <= band <= LOWEST_BAND:
            raise ValueError(f"{what}: {name!r}: expected a band, a whole number from "
                             f"{HIGHEST_BAND} to {LOWEST_BAND}")
        checked[name] = band
    return checked

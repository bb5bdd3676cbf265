"""What a constraint may cost: the library's limits, the compile's trial, the step's budget.

Why a module of its own: a constraint's size says little about its cost. A 17-character
regex, ``((a{60}){60}){60}``, compiles in a millisecond under the library's default
limits, then costs 50-150 ms of mask work per row per step on a 49k vocabulary (an
ordinary schema: 0.02 ms) and grows the process by about 55 MB, because llguidance
builds its lexer lazily, in the step, derivative by derivative. So the cost is bounded
three times over, each bound where it can act:

* ``LIMITS``: the library's own fuel and state limits (``llguidance.LLParserLimits``),
  tight: a lexer that would construct too many expressions or states stops with an
  error instead of growing. Measured on the embedded model's tokenizer: the nested-count
  regexes above then fail within their first mask (about 8 ms of CPU once, refused:
  ``trial``), ordinary schemas, regexes and grammars compile as before (1-5 ms, with
  a 60-property schema, formats and a 400-string enum; their masks 0.02-1.6 ms).
* ``trial`` at compile: the first ``TRIAL_MASKS`` masks are computed (walking the
  grammar by its lowest allowed token), timed in this thread's CPU time (a loaded
  machine does not make them look dearer), against ``trial_mask_ms``. A constraint
  that errors there (the library's "too many expressions constructed") or costs more
  is refused at compile, 4xx, and never cached; before, it was cached and failed at
  the first token of every request, a 500.
* ``mask_ms`` in the step (``sampling.constrain``): a row whose mask took longer ends
  with an error event, alone; the library cannot be interrupted mid-mask, so one such
  mask is the most a row can cost the step, and the limits bound that mask.

Memory: the library reports no template's size, so ``measure_bytes`` takes the
process's resident growth across a compile and its trial (compiles are serialised, so
it is mostly theirs), at least ``MIN_TEMPLATE_BYTES``; a template over
``max_template_bytes`` is refused, and the cache (``constraint_cache``) is bounded by
these bytes with a per-owner share. Later lazy growth is bounded by ``max_lexer_states``
(the library: about 1-2 kB a state).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

# The library's limits (its defaults in brackets). Fuel is its unit of work: about 50k
# per ms for the initial lexer, 14k per ms in a step's lexer, 20k items per ms.
LIMITS: dict[str, int] = {
    "initial_lexer_fuel": 20_000,  # [1,000,000] the expressions a lexer builds
    "step_lexer_fuel": 20_000,  # [200,000] lexer work per mask
    "step_max_items": 10_000,  # [50,000] Earley items per mask
    "max_lexer_states": 10_000,  # [250,000] about 1-2 kB each: <= 20 MB a template
    "max_grammar_size": 100_000,  # [500,000] symbols in the grammar's productions
}
# Masks tried at compile: the start's and a few after it (a lexer's cost shows at its
# first derivatives: the nested counts' within the first one).
TRIAL_MASKS = 8
# A schema's string patterns tried alone at compile (``schema_patterns``), at most; the
# rest are bounded by the limits and the step's budget.
MAX_PATTERNS_TRIED = 64
# A template costs at least this much memory in the cache's accounting (an estimate
# below it is measurement noise: an ordinary schema's template is tens of kB).
MIN_TEMPLATE_BYTES = 64 * 1024
# A row's mask in the step, at most (CPU ms): an ordinary schema's is 0.02-1.6 ms on the
# embedded model's 49k vocabulary; the nested counts' were 50-150 ms, every step.
MASK_MS = 20.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True, slots=True)
class ConstraintCosts:
    """The bounds on what constraints may cost one engine.

    Attributes:
        limits: the library's ``LLParserLimits`` (None: the library's defaults, only
            for tests that need a dear constraint to reach the step).
        trial_mask_ms: the most CPU time one mask of the compile's trial may take.
        mask_ms: the most CPU time one row's mask may take in the step.
        max_template_bytes: a template measured over this is refused at compile.
        cache_bytes: the compiled templates kept, in bytes (estimated).
        share_bytes: the most of those one owner (an API key) may hold.
    """

    limits: dict[str, int] | None = field(default_factory=lambda: dict(LIMITS))
    trial_mask_ms: float = 10.0
    mask_ms: float = MASK_MS
    max_template_bytes: int = 16 * 1024 * 1024
    cache_bytes: int = 128 * 1024 * 1024
    share_bytes: int = 32 * 1024 * 1024

    def library_limits(self) -> Any:
        """The limits as the library takes them (None: its defaults)."""
        if self.limits is None:
            return None
        import llguidance

        return llguidance.LLParserLimits(**self.limits, verbose_errors=False)  # type: ignore[arg-type]


class TrialFailed(Exception):
    """The compile's trial refused the constraint; the message says why."""


def trial(template: Any, costs: ConstraintCosts, eos: frozenset[int]) -> None:
    """Compute the template's first masks on a copy, walking by the lowest allowed
    token that is not an end; raise TrialFailed if one errors or costs more than
    ``costs.trial_mask_ms``. Then the template's own start mask (the start's lexer
    states, built here rather than in the step), once the copy showed it cheap: a
    refused constraint pays for one failing mask, not two."""
    walker = template.deep_copy()
    for index in range(TRIAL_MASKS):
        started = time.thread_time()
        mask = walker.compute_bitmask()
        spent_ms = (time.thread_time() - started) * 1000
        if walker.is_error():
            raise TrialFailed(f"its mask {index} fails: {first_line(walker.get_error())}")
        if spent_ms > costs.trial_mask_ms:
            raise TrialFailed(
                f"its mask {index} took {spent_ms:.0f} ms of CPU, over the budget of "
                f"{costs.trial_mask_ms:g} ms a mask")
        token = _lowest_allowed(mask, eos)
        if token is None or walker.is_stopped():
            break
        if not walker.consume_token(token) or walker.is_error():
            raise TrialFailed(f"its mask {index} fails: {first_line(walker.get_error())}")
    template.compute_bitmask()
    if template.is_error():
        raise TrialFailed(f"its mask 0 fails: {first_line(template.get_error())}")


def schema_patterns(schema: object, found: list[str] | None = None) -> list[str]:
    """Every regex a JSON schema holds (``pattern``, ``patternProperties``' keys), each
    once, at most ``MAX_PATTERNS_TRIED``: each is tried alone at compile, since the
    walk of ``trial`` reaches a string's lexer only where its property comes first
    (a tool's third parameter's pattern would first cost in the step)."""
    found = [] if found is None else found
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str) and value not in found:
                found.append(value)
            elif key == "patternProperties" and isinstance(value, dict):
                found.extend(p for p in value if isinstance(p, str) and p not in found)
            if not isinstance(value, str):
                schema_patterns(value, found)
    elif isinstance(schema, list):
        for item in schema:
            schema_patterns(item, found)
    return found[:MAX_PATTERNS_TRIED]


def resident_bytes() -> int:
    """This process's resident memory (Linux's ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def template_bytes(grown: int, grammar: str) -> int:
    """A template's size in the cache's accounting: the resident growth measured over
    its compile and trial, at least ``MIN_TEMPLATE_BYTES`` and its grammar's text."""
    return max(grown, MIN_TEMPLATE_BYTES, 16 * len(grammar))


def first_line(error: str) -> str:
    """The library's message without the state dump that follows it."""
    return error.strip().split("\n<state>", 1)[0].strip()


def _lowest_allowed(mask: bytes, eos: frozenset[int]) -> int | None:
    """The lowest token id the bit mask allows that is not an end (None: only ends,
    or none)."""
    for offset, byte in enumerate(mask):
        if not byte:
            continue
        for bit in range(8):
            token = offset * 8 + bit
            if byte >> bit & 1 and token not in eos:
                return token
    return None

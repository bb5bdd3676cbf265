"""Constrained decoding: a request's constraint compiled once, a matcher per sequence.

A request may carry a ``types.Constraint``: a JSON schema, any JSON object, a regular
expression or a Lark grammar. The library is llguidance (why: ``docs/structured-
output.md``): its ``LLMatcher`` walks the grammar token by token and gives, at each
position, the mask of the tokens that may come next, eos only where the grammar may
end.

Compiling. ``Constraints.compile`` turns a constraint into a matcher at its start, the
template, under tight library limits, and tries its first masks against a cost budget
(``constraint_costs``: what a constraint may cost, and why); one that fails or costs
too much raises ``InvalidConstraint`` and is never kept. Templates are kept per tenant
(the request's prefix-cache namespace), bounded by bytes with a per-owner share
(``constraint_cache``), so a repeated schema compiles once per tenant; each sequence
gets a copy of it (``matcher``). It runs in the caller's thread (``Engine.submit``, or
``Engine.compile_constraint`` which a server runs in a worker thread while validating a
request), one compile at a time, never in the step, so a cached schema adds nothing to
a first token. The library's view of the tokenizer is built on the first compile
(seconds for a 49k vocabulary), under a lock.

In the step. Only the stepping thread touches a sequence's matcher: the runner applies
the mask of every constrained row to that row's logits before sampling
(``sampling.constrain``; an unconstrained batch does no mask work), and the token
recorder advances the matcher with the sampled token (``advance``): the grammar's end
finishes the sequence with STOP; a position where the grammar allows no token at all
(``ConstraintDeadEnd``) finishes it with ERROR, as does a mask over the step's budget
(``ConstraintOverBudget``). A sequence rebuilt from its tokens (a
stream resumed elsewhere) replays them through a fresh matcher; a preempted one keeps
its matcher, as it keeps its detokenizer. Pure Python apart from the library: no torch.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Hashable, Iterable
from typing import Any

from .constraint_cache import TemplateCache
from .constraint_costs import (
    ConstraintCosts,
    TrialFailed,
    first_line,
    resident_bytes,
    schema_patterns,
    template_bytes,
    trial,
)
from .errors import InvalidConstraint
from .json_bounds import bounded
from .types import Constraint, ConstraintKind

# JSON on one line, as ``json.dumps`` writes it: with the library's flexible whitespace
# a small model may spend its whole budget on newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintDeadEnd(Exception):
    """The constraint allows no token at this position."""


class ConstraintOverBudget(ConstraintDeadEnd):
    """A row's mask cost more than the step's budget (``ConstraintCosts.mask_ms``)."""


class ConstraintViolation(Exception):
    """A token the constraint does not allow was fed to its matcher."""


class Constraints:
    """Compiles constraints for one tokenizer; thread-safe.

    Args:
        tokenizer: the model's (a transformers fast tokenizer).
        vocab_size: the width of the model's logits (may pad past the tokenizer).
        eos_token_ids: the tokens that end a sequence: allowed where the grammar may end.
        costs: the bounds on a constraint's cost (``constraint_costs``).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None,
                 eos_token_ids: Iterable[int], costs: ConstraintCosts | None = None) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self.costs = costs or ConstraintCosts()
        self._limits = self.costs.library_limits()
        self._lock = threading.Lock()
        # One compile at a time: its resident growth is then mostly its own (the
        # template's size), and a burst of compiles cannot take every core.
        self._compiling = threading.Lock()
        self._library_tokenizer: Any = None
        self._cache = TemplateCache(self.costs.cache_bytes, self.costs.share_bytes)
        self.num_compiled = 0  # cache misses that compiled

    @property
    def cached_bytes(self) -> int:
        """The templates kept, in the cache's estimate."""
        return self._cache.bytes

    def matcher(self, constraint: Constraint, namespace: bytes = b"") -> Any:
        """A new matcher at the constraint's start, for one sequence."""
        template = self.compile(constraint, namespace)
        with self._lock:
            return template.deep_copy()

    def cached(self, constraint: Constraint, namespace: bytes = b"") -> bool:
        """Whether ``namespace`` has ``constraint`` compiled; never waits (False while
        another thread holds the cache's lock: the first compile builds the library's
        tokenizer under it, seconds), so an event loop may ask."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._cache.get((namespace, constraint)) is not None
        finally:
            self._lock.release()

    def compile(self, constraint: Constraint, namespace: bytes = b"",
                owner: Hashable = None) -> Any:
        """The constraint's template matcher for ``namespace`` (the request's tenant),
        compiled on first use and kept within ``owner``'s share (None: the namespace's
        own); raises InvalidConstraint if the library refuses it, its trial fails or
        it is too big (then nothing is kept)."""
        key = (namespace, constraint)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                return template
            tokenizer = self._tokenizer()
        with self._compiling:  # outside the cache's lock: others' hits go on
            template, size = self._measured(tokenizer, constraint)
            if size > self.costs.max_template_bytes:  # or the step thread grew meanwhile:
                # measured again (the first kept meanwhile, so that the second cannot
                # reuse its freed pages), and the smaller taken
                template, again = self._measured(tokenizer, constraint)
                size = min(size, again)
        if size > self.costs.max_template_bytes:
            raise InvalidConstraint(
                f"the {constraint.kind.value} costs too much: about {size >> 20} MB "
                f"compiled, over the limit of {self.costs.max_template_bytes >> 20} MB")
        with self._lock:
            self.num_compiled += 1
            self._cache.put(key, template, namespace if owner is None else owner, size)
        return template

    def _measured(self, tokenizer: Any, constraint: Constraint) -> tuple[Any, int]:
        """The template, compiled and tried, and its size as ``template_bytes`` takes
        it (call under ``_compiling``); raises InvalidConstraint if it fails."""
        before = resident_bytes()
        template, grammar = _compile(tokenizer, constraint, self._limits)
        try:  # a schema's patterns first: each alone is the cheaper to refuse
            self._trial_patterns(tokenizer, constraint)
            trial(template, self.costs, frozenset(self._eos))
        except TrialFailed as exc:
            raise InvalidConstraint(
                f"the {constraint.kind.value} costs too much: {exc}") from None
        return template, template_bytes(resident_bytes() - before, grammar)

    def _trial_patterns(self, tokenizer: Any, constraint: Constraint) -> None:
        """A JSON schema's string patterns, each tried alone as a regex (raises
        TrialFailed): the schema's own trial may never reach them."""
        if constraint.kind is not ConstraintKind.JSON_SCHEMA:
            return
        for pattern in schema_patterns(json.loads(constraint.source)):
            try:
                template, _ = _compile(tokenizer, Constraint(ConstraintKind.REGEX, pattern),
                                       self._limits)
            except InvalidConstraint:  # the schema's own syntax compiled it: not a cost
                continue
            try:
                trial(template, self.costs, frozenset(self._eos))
            except TrialFailed as exc:
                raise TrialFailed(f"its pattern {pattern[:40]!r}: {exc}") from None

    def _tokenizer(self) -> Any:
        """The library's view of the tokenizer, built once (call under the lock)."""
        if self._library_tokenizer is None:
            import llguidance.hf

            self._library_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos or None)
        return self._library_tokenizer


def advance(matcher: Any, token_id: int) -> bool:
    """Feed one token to a sequence's matcher; whether the grammar has ended with it.

    Raises ConstraintViolation if the grammar does not allow it (a token sampled from
    the mask always is; a token replayed from elsewhere may not be)."""
    if not matcher.consume_token(token_id):
        error = first_line(matcher.get_error())
        raise ConstraintViolation(f"token {token_id} is not allowed by the constraint: {error}")
    return bool(matcher.is_stopped())


def _compile(tokenizer: Any, constraint: Constraint, limits: Any) -> tuple[Any, str]:
    """The template at the constraint's start, under ``limits``, and its grammar."""
    import llguidance

    try:
        grammar = _grammar(llguidance.LLMatcher, constraint)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InvalidConstraint(f"the {constraint.kind.value} does not compile: {exc}") from exc
    if template.is_error():
        raise InvalidConstraint(
            f"the {constraint.kind.value} does not compile: {first_line(template.get_error())}")
    return template, grammar


def _grammar(matcher: Any, constraint: Constraint) -> str:
    """The library's grammar text for ``constraint``."""
    kind, source = constraint.kind, constraint.source
    if kind is ConstraintKind.JSON_OBJECT:
        return str(matcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS))
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema is an object (or true or false)")
        return str(matcher.grammar_from_json_schema(bounded(schema), overrides=JSON_OPTIONS))
    if kind is ConstraintKind.REGEX:
        return str(matcher.grammar_from_regex(source))
    return str(matcher.grammar_from_lark(source))

"""Constrained decoding: a request's constraint compiled once, a matcher per sequence.

A request may carry a ``types.Constraint``: a JSON schema, any JSON object, a regular
expression or a Lark grammar. The library is llguidance (why: ``docs/structured-
output.md``): its ``LLMatcher`` walks the grammar token by token and gives, at each
position, the mask of the tokens that may come next, eos only where the grammar may
end.

Compiling. ``Constraints.compile`` turns a constraint into a matcher at its start, the
template, kept in a bounded LRU keyed by the (frozen) constraint, so a repeated schema
compiles once; each sequence gets a copy of it (``matcher``). It runs in the caller's
thread (``Engine.submit``, or ``Engine.compile_constraint`` which a server runs in a
worker thread while validating a request), never in the step, so a cached schema adds
nothing to a first token. The library's view of the tokenizer is built on the first
compile (seconds for a 49k vocabulary), under a lock. A constraint the library refuses
raises ``InvalidConstraint`` with its message, before anything is queued.

In the step. Only the stepping thread touches a sequence's matcher: the runner applies
the mask of every constrained row to that row's logits before sampling
(``sampling.constrain``; an unconstrained batch does no mask work), and the token
recorder advances the matcher with the sampled token (``advance``): the grammar's end
finishes the sequence with STOP; a position where the grammar allows no token at all
(``ConstraintDeadEnd``) finishes it with ERROR. A sequence rebuilt from its tokens (a
stream resumed elsewhere) replays them through a fresh matcher; a preempted one keeps
its matcher, as it keeps its detokenizer. Pure Python apart from the library: no torch.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from .errors import InvalidConstraint
from .json_bounds import bounded
from .types import Constraint, ConstraintKind

# Compiled constraints kept: a server's clients tend to send a few schemas again and
# again; a template is a few hundred kB at most.
DEFAULT_CACHE_SIZE = 128
# JSON on one line, as ``json.dumps`` writes it: with the library's flexible whitespace
# a small model may spend its whole budget on newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintDeadEnd(Exception):
    """The constraint allows no token at this position."""


class ConstraintViolation(Exception):
    """A token the constraint does not allow was fed to its matcher."""


class Constraints:
    """Compiles constraints for one tokenizer; thread-safe.

    Args:
        tokenizer: the model's (a transformers fast tokenizer).
        vocab_size: the width of the model's logits (may pad past the tokenizer).
        eos_token_ids: the tokens that end a sequence: allowed where the grammar may end.
        max_cached: compiled constraints kept (least recently used go first).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None,
                 eos_token_ids: Iterable[int], max_cached: int = DEFAULT_CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._library_tokenizer: Any = None
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self.num_compiled = 0  # cache misses that compiled

    def matcher(self, constraint: Constraint) -> Any:
        """A new matcher at the constraint's start, for one sequence."""
        template = self.compile(constraint)
        with self._lock:
            return template.deep_copy()

    def compile(self, constraint: Constraint) -> Any:
        """The constraint's template matcher, compiled on first use; raises
        InvalidConstraint if the library refuses it."""
        with self._lock:
            template = self._cache.get(constraint)
            if template is not None:
                self._cache.move_to_end(constraint)
                return template
            tokenizer = self._tokenizer()
        template = _compile(tokenizer, constraint)  # outside the lock: others' hits go on
        with self._lock:
            self.num_compiled += 1
            self._cache[constraint] = template
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return template

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
        error = _first_line(matcher.get_error())
        raise ConstraintViolation(f"token {token_id} is not allowed by the constraint: {error}")
    return bool(matcher.is_stopped())


def _compile(tokenizer: Any, constraint: Constraint) -> Any:
    import llguidance

    try:
        grammar = _grammar(llguidance.LLMatcher, constraint)
        template = llguidance.LLMatcher(tokenizer, grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InvalidConstraint(f"the {constraint.kind.value} does not compile: {exc}") from exc
    if template.is_error():
        raise InvalidConstraint(
            f"the {constraint.kind.value} does not compile: {_first_line(template.get_error())}")
    template.compute_bitmask()  # the start's lexer states: built here, not in the step
    return template


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


def _first_line(error: str) -> str:
    """The library's message without the state dump that follows it."""
    return error.strip().split("\n<state>", 1)[0].strip()

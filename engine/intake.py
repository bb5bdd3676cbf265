"""A request's way in: its checks, its prompt's ids, its constraint, the Sequence it becomes.

``Intake.sequence`` does, in the caller's thread (``Engine.submit``), everything a
request needs before the stepping thread sees it: validation, encoding the prompt
(unless its ids were given), the budget check, the detokenizer, stop matcher and
generator, and, for a constrained request, its grammar's matcher (``constraints``:
compiled here, or found compiled, never in the step). Whatever it refuses raises an
``InvalidRequest`` and nothing is queued.

Prompts are encoded with the intake's own ``text.PromptEncoder`` (any thread, its own
copy of the tokenizer); the detokenizers share the engine's tokenizer, used only in the
stepping thread.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from .constraint_costs import ConstraintCosts
from .constraints import Constraints
from .errors import EmptyPrompt, InvalidMaxNewTokens, PromptTooLong
from .model_side import ModelSource, Runner
from .sequence import Sequence
from .text import IncrementalDetokenizer, PromptEncoder, StopMatcher, text_decoder
from .types import Constraint, GenerationRequest
from .validation import validate_given_ids, validate_request, vocab_size_of


class Intake:
    """Turns requests into sequences for one engine.

    Args:
        loaded: the model and tokenizer.
        runner: the model side (its generators).
        max_positions: the most positions a sequence may take (model context, cache).
        eos_token_ids: the engine's: where a constraint may end.
        costs: the bounds on a constraint's cost (None: the defaults).
    """

    def __init__(self, loaded: ModelSource, runner: Runner, max_positions: int,
                 eos_token_ids: frozenset[int], costs: ConstraintCosts | None = None) -> None:
        self.vocab_size = vocab_size_of(loaded)  # token ids given to submit are below it
        self.tokenizer: Any = loaded.tokenizer  # the stepping thread's: detokenizers use it
        self._text_decoder = text_decoder(loaded.tokenizer)
        self.encoder = PromptEncoder(loaded.tokenizer, max_tokens=loaded.max_context)
        self.constraints = Constraints(loaded.tokenizer, self.vocab_size, eos_token_ids,
                                       costs)
        self._runner = runner
        self._max_positions = max_positions

    @property
    def max_positions(self) -> int:
        """The most positions a sequence may take: its prompt and new tokens together."""
        return self._max_positions

    def sequence(self, request: GenerationRequest, resume_from: Seq[int] = ()) -> Sequence:
        """The checked request as a new sequence (see ``Engine.submit``)."""
        validate_request(request)
        given = request.prompt_token_ids
        validate_given_ids(request, resume_from, self.vocab_size)
        prompt_ids = list(given) if given is not None else self.encoder.encode(request.prompt)
        if not prompt_ids:
            raise EmptyPrompt("the prompt is empty")
        if len(resume_from) > request.max_new_tokens:
            raise InvalidMaxNewTokens(f"{len(resume_from)} tokens to resume from, over "
                                      f"max_new_tokens ({request.max_new_tokens})")
        self.check_budget(len(prompt_ids), request.max_new_tokens)
        constraint = request.constraint
        return Sequence(
            request=request,
            prompt_ids=prompt_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, self._text_decoder),
            stop_matcher=StopMatcher(tuple(request.stop)),
            generator=self._runner.new_generator(request.sampling),
            generated_ids=list(resume_from),
            matcher=None if constraint is None else self.constraints.matcher(
                constraint, request.cache_namespace),
        )

    def compile(self, constraint: Constraint, namespace: bytes = b"",
                owner: Hashable = None) -> None:
        """Compile ``constraint`` now for ``namespace`` (cached, within ``owner``'s
        share), raising InvalidConstraint if it does not."""
        self.constraints.compile(constraint, namespace, owner)

    def check_budget(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise PromptTooLong if the request can never fit the cache or the model."""
        total = prompt_tokens + max_new_tokens
        if total > self._max_positions:
            raise PromptTooLong(
                f"prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) "
                f"is {total}, over the limit of {self._max_positions} tokens"
            )

    def render_chat(self, messages: Seq[Mapping[str, str]], add_generation_prompt: bool,
                    tools: Seq[Mapping[str, Any]] | None = None) -> tuple[str, list[int]]:
        return self.encoder.render_chat(messages, add_generation_prompt, tools)

"""One request's life inside the engine.

A ``Sequence`` is created when a request is submitted, and lives in the
scheduler until it finishes. Only the thread running ``step()`` touches it once
the step has applied its submit. Pure Python: the generator is the model
runner's (a ``torch.Generator`` for the real one), opaque here.

Prefill and recompute. Before a sequence decodes, its ``prefill_ids`` must be in
the cache: the prompt for a fresh sequence; after a preemption (``forget_cache``)
the prompt plus every generated token but the last, whose keys and values the cache
lost with its blocks (the model runner prefills the prompt and replays the generated
tokens as the decode rows that made them: ``ModelRunner.mixed_logits``). The last
generated token is then fed to the next decode as usual, so a recompute samples
nothing: the generator is not drawn from and the stream goes on exactly as if it had
never stopped. A sequence made already holding
``generated_ids`` (a stream rebuilt elsewhere) starts in that same state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_allocator import BlockTable
    from .text import IncrementalDetokenizer, StopMatcher
    from .types import GenerationRequest


class SequenceState(enum.Enum):
    WAITING = "waiting"  # submitted or preempted, not admitted: holds no blocks
    RUNNING = "running"  # admitted: holds its block table and a batch slot
    FINISHED = "finished"  # left the engine: its blocks went back exactly once


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher
    generator: object | None  # the runner's random source for a sampled request
    state: SequenceState = SequenceState.WAITING
    generated_ids: list[int] = field(default_factory=list)
    block_table: BlockTable | None = None
    is_paused: bool = False
    num_prefilled: int = 0  # positions of prefill_ids whose keys/values are cached
    # Generated tokens the next prefill caches again: 0 for a fresh sequence; after a
    # preemption all but the last generated token (see forget_cache).
    num_recompute: int = 0
    num_preemptions: int = 0  # times this sequence lost its blocks to a preemption
    num_priority_preemptions: int = 0  # of those, for a higher band (``engine.priority``)
    generated_at_priority_preemption: int = 0  # its tokens then (``engine.priority``)
    submitted_at: float | None = None  # the scheduler's clock when its submit was applied
    was_admitted: bool = False  # once admitted (its queue wait is counted then)
    # Aging (``engine.aging``): the band aging admitted it at, kept while it runs (None:
    # its request's), and the step it last entered the waiting queue at (its wait).
    aged_band: int | None = None
    entered_queue_step: int = 0
    # The scheduler's plan it last decoded in beside a higher band's prompt
    # (``engine.band_yield``: a lower band's decode rows ride those steps in turn).
    last_decode_plan: int = 0
    num_lost: int = 0  # positions cached when last preempted: the ones computed again
    # Prompt positions its first admission found in the prefix cache (None before it):
    # what its usage reports as cached. A later admission, after a preemption, does not
    # change it: the client is told what its request cost when it was first taken.
    num_cached_prompt_tokens: int | None = None
    # The identities of its full blocks, as far as computed (``prefix_cache``): memoized,
    # its tokens never change.
    block_digests: list[bytes] = field(default_factory=list)
    # Where its constraint's grammar stands after ``generated_ids`` (``constraints``),
    # None when unconstrained; like the detokenizer it survives a preemption.
    matcher: object | None = None

    def __post_init__(self) -> None:
        if self.generated_ids:  # a stream rebuilt elsewhere: recompute what it had
            self.forget_cache()

    def forget_cache(self) -> None:
        """The cache no longer holds this sequence (its blocks went back): its next
        prefill computes ``prefill_ids`` from position 0, sampling nothing."""
        self.num_lost = self.num_prefilled if self.needs_prefill else self.num_cached
        self.num_prefilled = 0
        self.num_recompute = max(len(self.generated_ids) - 1, 0)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_tokens(self) -> int:
        """Positions this sequence can ever occupy: what a reserving admission takes."""
        return len(self.prompt_ids) + self.request.max_new_tokens

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens to cache before decoding: the prompt, then (for a recompute) the
        generated tokens but the last."""
        return self.prompt_ids + self.generated_ids[: self.num_recompute]

    @property
    def prefill_end(self) -> int:
        """How many positions prefill caches: ``len(prefill_ids)``."""
        return len(self.prompt_ids) + self.num_recompute

    @property
    def num_to_cache(self) -> int:
        """Positions still to prefill before this sequence can decode."""
        return self.prefill_end - self.num_prefilled

    @property
    def needs_prefill(self) -> bool:
        """Whether prefill (a fresh prompt, or a recompute) must run before decoding."""
        return self.num_prefilled < self.prefill_end

    @property
    def num_cached(self) -> int:
        """Positions whose keys/values are in the cache once decoding: all but the
        newest token (while ``needs_prefill``, ``num_prefilled`` are)."""
        return len(self.prompt_ids) + len(self.generated_ids) - 1

    @property
    def last_token_id(self) -> int:
        return self.generated_ids[-1]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Positions ``start`` to ``end`` of one sequence's ``prefill_ids``, prefilled in
    one pass."""

    seq: Sequence
    start: int
    end: int

    @property
    def ids(self) -> list[int]:
        """The token ids this chunk writes into the cache."""
        return self.seq.prefill_ids[self.start : self.end]

    @property
    def is_last(self) -> bool:
        """Whether this chunk completes the sequence's prefill."""
        return self.end == self.seq.prefill_end

    @property
    def samples(self) -> bool:
        """Whether its pass samples a token: only a fresh prompt's last chunk does (a
        recompute ends on a token already generated, fed to the next decode)."""
        return self.is_last and not self.seq.generated_ids

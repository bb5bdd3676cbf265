"""One request's life inside the engine.

A ``Sequence`` is created when a request is submitted, and lives in the
scheduler until it finishes. Only the thread running ``step()`` touches it once
the step has applied its submit. Pure Python: the generator is the model
runner's (a ``torch.Generator`` for the real one), opaque here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_manager import BlockTable
    from .text import IncrementalDetokenizer, StopMatcher
    from .types import GenerationRequest


class SequenceState(enum.Enum):
    WAITING = "waiting"  # submitted, not admitted: holds no blocks
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
    num_prefilled: int = 0  # prompt positions whose keys/values are cached (chunked prefill)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_tokens(self) -> int:
        """Positions this sequence can ever occupy: what admission reserves."""
        return len(self.prompt_ids) + self.request.max_new_tokens

    @property
    def num_cached(self) -> int:
        """Positions whose keys/values are in the cache (all but the newest token)."""
        return len(self.prompt_ids) + len(self.generated_ids) - 1

    @property
    def last_token_id(self) -> int:
        return self.generated_ids[-1]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prompt positions ``start`` to ``end`` of one sequence, prefilled in one pass."""

    seq: Sequence
    start: int
    end: int

    @property
    def ids(self) -> list[int]:
        """The token ids this chunk writes into the cache."""
        return self.seq.prompt_ids[self.start : self.end]

    @property
    def is_last(self) -> bool:
        """Whether this chunk completes the prompt: its pass samples the first token."""
        return self.end == self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Whether its pass samples a token (the first, with the prompt's last chunk)."""
        return self.is_last

"""What the engine needs of its model side: the loaded model and the runner of its passes.

The engine wires pure-Python scheduling to a model it never imports: these protocols
are all it assumes, so that tests drive it with a scripted runner (``tests/
scripted_runner.py``), the tools with a simulated one (``tools/simulated.py``) or one
that prefills a prompt a pass (``tools/serial_prefill.py``), and the product with
``model_runner.ModelRunner`` over ``model.LoadedModel``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, Protocol

from .logprobs import Outcome
from .sequence import Chunk, Sequence
from .types import SamplingParams


class ModelSource(Protocol):
    """What the engine needs of a loaded model (``engine.model.LoadedModel`` is one)."""

    @property
    def tokenizer(self) -> Any: ...  # encode/decode like a transformers tokenizer
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def max_context(self) -> int: ...


class Runner(Protocol):
    """The model side of a step (``engine.model_runner.ModelRunner`` is the real one).

    ``prefill`` and ``decode`` return one outcome per chunk or sequence, in order: the
    token sampled for it (a ``logprobs.Sampled`` if its request asked for
    log-probabilities: a runner that gives a bare id gives none), the exception sampling
    it raised, or (a chunk that does not end its prompt) None; ``mixed`` runs both in
    one forward pass and returns both. An exception they raise themselves concerns the
    whole pass.
    """

    def new_generator(self, params: SamplingParams) -> object | None: ...
    def advance_generator(self, generator: object | None, generated_ids: list[int]) -> None:
        """Bring a new generator to where it was after sampling ``generated_ids``."""
        ...

    def prefill(self, chunks: list[Chunk]) -> Seq[Outcome | None]: ...
    def decode(self, seqs: list[Sequence]) -> Seq[Outcome]: ...
    def mixed(
        self, chunks: list[Chunk], seqs: list[Sequence]
    ) -> tuple[Seq[Outcome | None], Seq[Outcome]]: ...

"""A scripted model for the engine: the real Engine and Scheduler, no torch.

``ScriptedRunner`` stands in for ``engine.model_runner.ModelRunner``: the next token
is a function of the previous one (letters count up, ``z`` is followed by ``EOS``),
so a run's tokens, its stop strings and its eos are known in advance. It records
every pass (who was prefilled together, who was decoded together) and fails where
told. ``ScriptedTokenizer`` makes one token of each character (the id is the code
point), so prompt lengths are character counts. Nothing here imports torch.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams
from engine.engine import Engine
from engine.sequence import Chunk, Sequence

EOS = 0  # decodes to nothing, like a special token


class ScriptedTokenizer:
    """One token per character: ``encode("ab") == [97, 98]``."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


@dataclass(frozen=True)
class ScriptedModel:
    """What the engine needs of a loaded model (``engine.engine.ModelSource``)."""

    tokenizer: Any = field(default_factory=ScriptedTokenizer)
    eos_token_ids: frozenset[int] = frozenset({EOS})
    max_context: int = 4096


def next_token(previous: int) -> int:
    """``a``..``y`` count up, ``z`` ends with EOS, anything else starts at ``a``."""
    if previous == ord("z"):
        return EOS
    return previous + 1 if ord("a") <= previous < ord("z") else ord("a")


class ScriptedFault(RuntimeError):
    pass


class ScriptedRunner:
    """The engine's ``Runner``; ``fail_prefill`` and ``fail_decode`` name request ids
    whose presence makes that forward pass raise; ``fail_sample`` ids get a per-row
    exception instead of a token."""

    def __init__(
        self,
        *,
        fail_prefill: frozenset[str] = frozenset(),
        fail_decode: frozenset[str] = frozenset(),
        fail_sample: frozenset[str] = frozenset(),
    ) -> None:
        self.fail_prefill = fail_prefill
        self.fail_decode = fail_decode
        self.fail_sample = fail_sample
        self.prefills: list[list[str]] = []  # request ids of each prefill pass, in order
        self.decodes: list[list[str]] = []  # request ids of each decode pass, in order
        self.chunks: list[list[tuple[str, int, int]]] = []  # (id, start, end) per prefill
        self.mixes = 0  # passes that carried both (recorded in prefills and decodes too)

    def new_generator(self, params: SamplingParams) -> random.Random | None:
        return None if params.temperature == 0.0 else random.Random(params.seed)

    def advance_generator(self, generator: object | None, generated_ids: list[int]) -> None:
        """``_sample`` draws once for every token but EOS."""
        if isinstance(generator, random.Random):
            for token in generated_ids:
                if token != EOS:
                    generator.randrange(3)

    def prefill(self, chunks: list[Chunk]) -> list[int | Exception | None]:
        seqs = [c.seq for c in chunks]
        self.prefills.append([s.request_id for s in seqs])
        self.chunks.append([(c.seq.request_id, c.start, c.end) for c in chunks])
        self._maybe_fail(seqs, self.fail_prefill, "prefill")
        return [self._sample(c.seq, c.ids[-1]) if c.samples else None for c in chunks]

    def decode(self, seqs: list[Sequence]) -> list[int | Exception]:
        self.decodes.append([s.request_id for s in seqs])
        self._maybe_fail(seqs, self.fail_decode, "decode")
        return [self._sample(s, s.last_token_id) for s in seqs]

    def mixed(
        self, chunks: list[Chunk], seqs: list[Sequence]
    ) -> tuple[list[int | Exception | None], list[int | Exception]]:
        """Both in one pass: recorded in ``prefills``/``chunks`` and ``decodes`` as the
        two passes would be, and counted in ``mixes``; it fails (recording nothing)
        where either would."""
        self._maybe_fail([c.seq for c in chunks], self.fail_prefill, "mixed")
        self._maybe_fail(seqs, self.fail_decode, "mixed")
        self.mixes += 1
        return self.prefill(chunks), self.decode(seqs)

    def _maybe_fail(self, seqs: list[Sequence], ids: frozenset[str], what: str) -> None:
        if any(s.request_id in ids for s in seqs):
            raise ScriptedFault(f"scripted {what} failure")

    def _sample(self, seq: Sequence, previous: int) -> int | Exception:
        if seq.request_id in self.fail_sample:
            return ScriptedFault("scripted sampling failure")
        token = next_token(previous)
        if isinstance(seq.generator, random.Random) and token != EOS:
            token = ord("a") + (token - ord("a") + seq.generator.randrange(3)) % 25
        return token


def scripted_engine(runner: ScriptedRunner | None = None, **options: Any) -> Engine:
    """A real Engine over the scripted model; small blocks, so limits are easy to reach."""
    options = {"max_batch": 8, "num_blocks": 64, "block_size": 4, **options}
    return Engine(ScriptedModel(), runner=runner or ScriptedRunner(), **options)

"""The model's side of a step: cache tensors, batch building, forward pass, sampling.

``ModelRunner`` is the only part of the engine that touches torch tensors. The
scheduler hands it the sequences of a step; it returns one outcome per sequence,
the sampled token id or the exception sampling that row raised (the scheduler's
per-sequence error boundary turns it into a finish). An exception from the
forward pass itself propagates: it concerns every sequence in that batch.

A prefill packs every chosen prompt into ONE forward pass (see ``attention``):
the rows of the linear layers are computed independently and attention runs per
prompt, so each prompt's logits, and therefore its first token, are the ones a
prefill of that prompt alone would give. A decode runs one new position for
every decode row in one forward pass. A mixed pass (``mixed``) does both in ONE
forward pass, the chunks' tokens then one token per decode row, so that a step
pays the model's per-pass cost (weights streamed once, per-layer overheads) once.
The batch builders are ``attention.prefill_batch``, ``attention.decode_batch``
and ``attention.mixed_batch``, the ones the tests check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from . import sampling
from .attention import (
    ATTENTION_NAME,
    PagedBatch,
    decode_batch,
    mixed_batch,
    prefill_batch,
    register_paged_attention,
)
from .constraints import ConstraintDeadEnd
from .kv_cache import PagedKVCache

if TYPE_CHECKING:
    from .logprobs import Outcome
    from .model import LoadedModel
    from .sequence import Chunk, Sequence
    from .types import SamplingParams


class ModelRunner:
    """One model over one paged KV cache of ``num_blocks`` blocks of ``block_size``."""

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int) -> None:
        self.model = loaded.model
        self.device = loaded.device
        register_paged_attention()
        self.model.set_attn_implementation(ATTENTION_NAME)
        config = self.model.config
        num_heads = config.num_attention_heads
        self.cache = PagedKVCache(
            num_layers=config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            dtype=self.model.dtype,
            device=self.device,
        )

    def new_generator(self, params: SamplingParams) -> torch.Generator | None:
        return sampling.make_generator(params, self.device)

    def advance_generator(self, generator: object | None, generated_ids: list[int]) -> None:
        """Past the draws of ``generated_ids``: one sample each (``sampling.advance``)."""
        if isinstance(generator, torch.Generator):
            # out_features: the CPU layers keep no float weight (``engine.cpu_linear``)
            vocab_size = self.model.get_output_embeddings().out_features
            sampling.advance(generator, vocab_size, len(generated_ids))

    # prefill

    @torch.inference_mode()
    def prefill(self, chunks: list[Chunk]) -> list[Outcome | None]:
        """Run every chunk in one forward pass; sample the first token of each prompt
        whose last chunk this is (None for the others: no token, generator untouched)."""
        return self.mixed(chunks, [])[0]

    # decode

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[Outcome]:
        """One new token for every sequence of ``seqs``, in one forward pass."""
        return self._sample(seqs, self.decode_logits(seqs))

    def decode_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """The decode pass's logits, a row per sequence (call in inference mode)."""
        positions = self._decode_positions(seqs)
        batch = decode_batch(self.cache, self._tables(seqs), positions, self.model.dtype)
        input_ids = torch.tensor([[s.last_token_id] for s in seqs], device=self.device)
        return self.forward(input_ids, positions, batch, 1)

    # both

    @torch.inference_mode()
    def mixed(
        self, chunks: list[Chunk], seqs: list[Sequence]
    ) -> tuple[list[Outcome | None], list[Outcome]]:
        """``prefill(chunks)`` and ``decode(seqs)`` in ONE forward pass (``chunks`` not
        empty): the chunks' tokens packed, then each decode row's last token at its
        position ``num_cached``. The outcomes of both, as those two would give them."""
        logits = self.mixed_logits(chunks, seqs)
        done = [i for i, c in enumerate(chunks) if c.samples]
        rows_sampled = done + list(range(len(chunks), len(chunks) + len(seqs)))
        sampled = iter(self._sample([chunks[i].seq for i in done] + seqs, logits[rows_sampled])
                       if rows_sampled else [])
        prefilled = [next(sampled) if c.samples else None for c in chunks]
        return prefilled, [next(sampled) for _ in seqs]

    def mixed_logits(self, chunks: list[Chunk], seqs: list[Sequence]) -> torch.Tensor:
        """The mixed pass's logits: a row per chunk (its last position), then a row per
        decode row (call in inference mode)."""
        lengths = [c.end - c.start for c in chunks]
        starts = [c.start for c in chunks]
        batch, positions = prefill_batch(
            self.cache, self._tables([c.seq for c in chunks]), lengths, starts
        )
        ids = [t for c in chunks for t in c.ids]
        keep = torch.cumsum(torch.tensor(lengths, device=self.device), 0) - 1
        if seqs:
            rows = self._decode_positions(seqs)
            decode = decode_batch(self.cache, self._tables(seqs), rows, self.model.dtype)
            batch = mixed_batch(batch, decode)
            positions = torch.cat([positions, rows.T], dim=1)
            ids += [s.last_token_id for s in seqs]
            keep = torch.cat([keep, sum(lengths) + torch.arange(len(seqs), device=self.device)])
        return self.forward(torch.tensor([ids], device=self.device), positions, batch, keep)

    def _decode_positions(self, seqs: list[Sequence]) -> torch.Tensor:
        """(rows, 1): each decode row's new position."""
        return torch.tensor([[s.num_cached] for s in seqs], device=self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: PagedBatch,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        """Logits (rows, vocab): the last position of each row (``logits_to_keep=1``),
        or the positions ``logits_to_keep`` indexes in a packed row."""
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            paged=batch,
            use_cache=False,
            logits_to_keep=logits_to_keep,
        )
        logits = out.logits
        return logits[0] if isinstance(logits_to_keep, torch.Tensor) else logits[:, -1, :]

    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Block tables (rows, widest), padded with block 0: never read past a row's end."""
        tables = [s.block_table.block_ids for s in seqs]  # type: ignore[union-attr]
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Outcome]:
        """Each row's next token (with its log-probabilities if its request asked: the
        same logits, ``sampling.logprobs``), or the exception sampling that row raised;
        a constrained row's from the logits its grammar allows (``sampling.constrain``),
        a row whose grammar allows none gets ``ConstraintDeadEnd``."""
        dead = sampling.constrain(logits, [seq.matcher for seq in seqs])
        outcomes = sampling.sample(logits, [
            (seq.request.sampling, cast("torch.Generator | None", seq.generator))
            for seq in seqs])
        for row in dead:
            outcomes[row] = ConstraintDeadEnd("the constraint allows no further token")
        return outcomes

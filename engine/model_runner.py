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
every decode row in one forward pass. The batch builders are
``attention.prefill_batch`` and ``attention.decode_batch``, the ones the tests
check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from . import sampling
from .attention import ATTENTION_NAME, PagedBatch, decode_batch, prefill_batch
from .kv_cache import PagedKVCache

if TYPE_CHECKING:
    from .model import LoadedModel
    from .sequence import Chunk, Sequence
    from .types import SamplingParams


class ModelRunner:
    """One model over one paged KV cache of ``num_blocks`` blocks of ``block_size``."""

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int) -> None:
        self.model = loaded.model
        self.device = loaded.device
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

    # prefill

    @torch.inference_mode()
    def prefill(self, chunks: list[Chunk]) -> list[int | Exception | None]:
        """Run every chunk in one forward pass; sample the first token of each prompt
        whose last chunk this is (None for the others: no token, generator untouched)."""
        seqs = [c.seq for c in chunks]
        lengths = [c.end - c.start for c in chunks]
        starts = [c.start for c in chunks]
        batch, positions = prefill_batch(self.cache, self._tables(seqs), lengths, starts)
        ids = [t for c in chunks for t in c.seq.prompt_ids[c.start : c.end]]
        input_ids = torch.tensor([ids], device=self.device)
        last = torch.cumsum(torch.tensor(lengths, device=self.device), 0) - 1
        logits = self.forward(input_ids, positions, batch, last)
        done = [i for i, c in enumerate(chunks) if c.is_last]
        sampled = iter(self._sample([seqs[i] for i in done], logits[done]) if done else [])
        return [next(sampled) if c.is_last else None for c in chunks]

    # decode

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[int | Exception]:
        """One new token for every sequence of ``seqs``, in one forward pass."""
        positions = torch.tensor([[s.num_cached] for s in seqs], device=self.device)
        batch = decode_batch(self.cache, self._tables(seqs), positions, self.model.dtype)
        input_ids = torch.tensor([[s.last_token_id] for s in seqs], device=self.device)
        return self._sample(seqs, self.forward(input_ids, positions, batch, 1))

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

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int | Exception]:
        """Each row's next token, or the exception sampling that row raised."""
        greedy_ids = sampling.greedy(logits)
        outcomes: list[int | Exception] = []
        for row, seq in enumerate(seqs):
            generator = cast("torch.Generator | None", seq.generator)
            params = seq.request.sampling
            try:
                token = sampling.choose(logits[row], params, generator, greedy_ids[row])
            except Exception as exc:
                outcomes.append(exc)
            else:
                outcomes.append(token)
        return outcomes

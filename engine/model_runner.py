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
A recompute (a preempted or rebuilt sequence) prefills its prompt and replays its
generated tokens as decode rows in the same pass (``mixed_logits``).
The batch builders are ``paged_batch.prefill_batch``, ``paged_batch.decode_batch``
and ``paged_batch.mixed_batch``, the ones the tests check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from . import cpu_linear, llama_forward, penalties, sampling
from .attention import ATTENTION_NAME, register_paged_attention
from .constraint_costs import MASK_MS
from .kv_cache import PagedKVCache
from .paged_batch import PagedBatch, decode_batch, mixed_batch, prefill_batch

if TYPE_CHECKING:
    from .logprobs import Outcome
    from .model import LoadedModel
    from .sequence import Chunk, Sequence
    from .types import SamplingParams


class ModelRunner:
    """One model over one paged KV cache of ``num_blocks`` blocks of ``block_size``."""

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int,
                 mask_budget_ms: float = MASK_MS) -> None:
        self.model = loaded.model
        self.mask_budget_ms = mask_budget_ms  # a constrained row's mask, at most
        self.device = loaded.device
        register_paged_attention()
        self.model.set_attn_implementation(ATTENTION_NAME)
        # Linear layers that keep a row's result alone (bfloat16, int8 on a CPU): then its
        # prefill attention is made independent of the chunking too (paged_batch.PagedBatch).
        self.rows_alone = cpu_linear.rows_alone(self.model)
        # A Llama model's pass with fewer calls around the same ops (``llama_forward``).
        self.llama_pass = llama_forward.for_model(self.model)
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
        decode row (call in inference mode).

        A recompute's generated positions (a chunk's part past its prompt) run as decode
        rows, one a position, as the decode steps that first made them did: their keys
        and values, and so every later token's logits, are those steps' bit for bit (a
        row's linear layers and its attention depend on the row alone), where a causal
        prefill over them would differ in last bits (a near-tie or a seeded draw on a
        boundary could then change the rest of the answer)."""
        # Each chunk's (start, end) of prompt positions, prefilled packed; its positions
        # from end to its own end are generated tokens, replayed as decode rows.
        parts = [(c, c.start, max(c.start, min(c.end, c.seq.num_prompt_tokens))) for c in chunks]
        packed = [(c, start, end) for c, start, end in parts if end > start]
        replays = [(c.seq, q) for c, _, end in parts for q in range(end, c.end)]
        rows_seqs = [seq for seq, _ in replays] + seqs
        rows = torch.tensor([[q] for _, q in replays] + [[s.num_cached] for s in seqs],
                            device=self.device, dtype=torch.long).reshape(-1, 1)
        row_ids = [seq.prefill_ids[q] for seq, q in replays] + [s.last_token_id for s in seqs]
        lengths = [end - start for _, start, end in packed]
        kept = self._kept([(end - start, c.end - end) for c, start, end in parts],
                          sum(lengths), len(seqs))
        decode = None if not rows_seqs else decode_batch(
            self.cache, self._tables(rows_seqs), rows, self.model.dtype)
        if not packed:  # decode rows only: the decode pass's own shape
            assert decode is not None
            row_input = torch.tensor(row_ids, device=self.device).reshape(-1, 1)
            return self.forward(row_input, rows, decode, 1)[kept]
        batch, positions = prefill_batch(
            self.cache, self._tables([c.seq for c, _, _ in packed]), lengths,
            [start for _, start, _ in packed], rows_alone=self.rows_alone)
        ids = [t for c, start, end in packed for t in c.seq.prefill_ids[start:end]] + row_ids
        if decode is not None:
            batch = mixed_batch(batch, decode)
            positions = torch.cat([positions, rows.T], dim=1)
        return self.forward(torch.tensor([ids], device=self.device), positions, batch, kept)

    def _kept(self, parts: list[tuple[int, int]], packed: int, decoded: int) -> torch.Tensor:
        """The positions whose logits a mixed pass keeps: each chunk's last (of ``parts``,
        its packed and its replayed positions' counts), then every decode row's. The pass
        holds the ``packed`` positions, then the replayed rows, then the decode rows."""
        keep, packed_end, replay_end = [], 0, packed
        for packed_count, replay_count in parts:
            packed_end += packed_count
            replay_end += replay_count
            keep.append(replay_end - 1 if replay_count else packed_end - 1)
        keep += range(replay_end, replay_end + decoded)
        return torch.tensor(keep, device=self.device, dtype=torch.long)

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
        if self.llama_pass is not None:
            logits = self.llama_pass(input_ids, positions, batch, logits_to_keep)
            return logits[0] if isinstance(logits_to_keep, torch.Tensor) else logits[:, -1, :]
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
        a row whose grammar allows none, or whose mask cost more than the budget, gets
        its ``ConstraintDeadEnd``; a row with penalties or a logit bias has them applied
        next, from its own tokens (``penalties``)."""
        dead = sampling.constrain(logits, [seq.matcher for seq in seqs], self.mask_budget_ms)
        penalties.penalize(logits, [
            (seq.request.sampling, seq.prompt_ids, seq.generated_ids) for seq in seqs])
        outcomes = sampling.sample(logits, [
            (seq.request.sampling, cast("torch.Generator | None", seq.generator))
            for seq in seqs])
        for row, ended in dead.items():
            outcomes[row] = ended
        return outcomes

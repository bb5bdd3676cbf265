"""Where one forward pass writes and reads in the paged KV cache.

The model runner describes each pass as a ``PagedBatch`` (built by ``prefill_batch``,
``decode_batch`` and ``mixed_batch``): the slots its new keys and values go to, the
decode rows' read groups, the packed chunks' lengths and cached prefixes. Every layer's
attention (``engine.attention``) reads the same description. The padding rules that
keep a row's result its own (``PAD_TO``, ``PREFILL_PAD_TO``) live here, beside the
builders that apply them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import PagedKVCache

# A decode row is padded to the next multiple of this many positions (its own length's
# bucket). The gather of padded positions is what costs (memory-bound: a step's weights
# have pushed the cache out of the CPU's caches), a call of its own next to nothing:
# tools/paddingbench.py at a0b2ba5 --threads 1 (embedded model, 32 rows, 2-core CPU): lengths
# 40-300 took 569 ms a pass in one call, 248 ms in groups padded by at most 16; 40-1000
# 1,440 against 375 ms; 60-64 (one group either way) 191 and 193 ms; a call per length
# 249 and 376 ms. Buckets of 8 rather than 16: float32 through the side-by-side at N=32
# (mixed lengths) took 159.3 tokens/s against 159.8 before buckets (16: 160.5 against 165.2).
PAD_TO = 8


@dataclass(frozen=True, slots=True)
class ReadGroup:
    """Decode rows of one padded length, read back and attended in one call."""

    rows: torch.Tensor | None  # the group's rows of the decode batch; None: every row, in order
    slots: torch.Tensor  # (rows * padded,) the slots to gather
    bias: torch.Tensor  # (rows, 1, 1, padded): 0 for a real position, -inf for padding


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Where one forward pass writes and reads in the cache (shared by every layer)."""

    cache: PagedKVCache
    write_slots: torch.Tensor  # (batch * new_positions,) slots for the new keys/values
    reads: tuple[ReadGroup, ...] = ()  # decode, mixed: the decode rows' groups; prefill: none
    order: torch.Tensor | None = None  # the groups' rows, concatenated, back in batch order
    prompt_lengths: tuple[int, ...] = ()  # prefill, mixed: the packed chunks' lengths, in order
    # prefill: per chunk, None when it starts a prompt, else the slots of every position
    # up to its end (the cached ones before it included), to read its keys back.
    prefix_slots: tuple[torch.Tensor | None, ...] = ()
    # prefill, mixed: each chunk row attends in a call of its own padded length
    # (``_rows_alone``), so that where a prompt is cut changes none of its bits.
    rows_alone: bool = False


# A prefill row attends over its prompt's positions padded to the next multiple of this
# (its own length's bucket), one kernel call per chunk and bucket: a row's result is then
# the same however its prompt was chunked. Larger buckets are fewer calls and more
# masked positions; at 64 a packed prefill took about 1.1x the single causal call a chunk
# it replaced (docs/results.md, "Prefill rows independent of their chunking").
PREFILL_PAD_TO = 64


def prefill_length(length: int) -> int:
    """The length a prefill row of ``length`` positions attends over: its own bucket."""
    return -(-length // PREFILL_PAD_TO) * PREFILL_PAD_TO


def padded_length(length: int) -> int:
    """The length a decode row of ``length`` positions is padded to: its own bucket."""
    return -(-length // PAD_TO) * PAD_TO


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Row indices, longest first, grouped by ``padded_length`` (one group when the
    lengths share a bucket)."""
    groups: dict[int, list[int]] = {}
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        groups.setdefault(padded_length(lengths[row]), []).append(row)
    return list(groups.values())


def prefill_batch(
    cache: PagedKVCache, tables: torch.Tensor, lengths: list[int], starts: list[int] | None = None,
    *, rows_alone: bool = False,
) -> tuple[PagedBatch, torch.Tensor]:
    """A packed prefill of ``len(lengths)`` prompt chunks, and its position ids (1, total)
    (``rows_alone``: see ``PagedBatch``).

    ``tables`` (prompts, blocks) holds each prompt's block table, padded with any
    valid block id; chunk ``i`` occupies ``lengths[i]`` consecutive tokens of the row,
    its prompt's positions ``starts[i]`` to ``starts[i] + lengths[i]`` (``starts``
    defaults to zeros: whole prompts).
    """
    device = tables.device
    starts = starts or [0] * len(lengths)
    counts = torch.tensor(lengths, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    offsets = torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts - torch.tensor(starts, device=device), counts
    )
    positions = torch.arange(int(counts.sum()), device=device) - offsets
    slots = cache.slots(tables[rows], positions.unsqueeze(1)).flatten()
    prefix = tuple(
        None if start == 0
        else cache.slots(tables[i : i + 1], torch.arange(start + n, device=device)[None]).flatten()
        for i, (start, n) in enumerate(zip(starts, lengths, strict=True))
    )
    batch = PagedBatch(cache, slots, prompt_lengths=tuple(lengths), prefix_slots=prefix,
                       rows_alone=rows_alone)
    return batch, positions.unsqueeze(0)


def decode_batch(
    cache: PagedKVCache, tables: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> PagedBatch:
    """A decode of ``positions`` (batch, 1), the newest position of each row.

    ``tables`` (batch, blocks) is padded with any valid block id: no row reads past
    its own length (a padded position reads its newest again, masked out).
    """
    lengths = positions + 1
    groups = length_groups(lengths.flatten().tolist())
    write_slots = cache.slots(tables, positions).flatten()
    if len(groups) == 1:  # every row in one call, in batch order
        return PagedBatch(cache, write_slots, (_read_group(cache, tables, lengths, dtype, None),))
    device = tables.device
    reads = tuple(_read_group(cache, tables, lengths, dtype, torch.tensor(rows, device=device))
                  for rows in groups)
    order = torch.argsort(torch.tensor([r for rows in groups for r in rows], device=device))
    return PagedBatch(cache, write_slots, reads, order)


def _read_group(cache: PagedKVCache, tables: torch.Tensor, lengths: torch.Tensor,
                dtype: torch.dtype, rows: torch.Tensor | None) -> ReadGroup:
    """What the decode rows ``rows`` (None: all) of lengths ``lengths`` (batch, 1) read."""
    if rows is not None:
        tables, lengths = tables[rows], lengths[rows]
    width = padded_length(int(lengths.max()))  # every row of a group has this bucket
    span = torch.arange(width, device=lengths.device).expand(len(lengths), -1)
    bias = torch.zeros(span.shape, dtype=dtype, device=lengths.device)
    # A padded position reads the row's newest one again (masked out all the same): the
    # slot past a row's end was never written, and may hold NaN (kv_cache: 0 x NaN = NaN).
    read = torch.minimum(span, lengths - 1)
    return ReadGroup(rows, cache.slots(tables, read).flatten(),
                     bias.masked_fill_(span >= lengths, float("-inf"))[:, None, None, :])


def mixed_batch(prefill: PagedBatch, decode: PagedBatch) -> PagedBatch:
    """One pass of ``prefill``'s packed chunks followed by ``decode``'s rows (the
    model's row holds the chunks' tokens, then one token per decode row)."""
    return PagedBatch(
        prefill.cache,
        write_slots=torch.cat([prefill.write_slots, decode.write_slots]),
        reads=decode.reads,
        order=decode.order,
        prompt_lengths=prefill.prompt_lengths,
        prefix_slots=prefill.prefix_slots,
        rows_alone=prefill.rows_alone,
    )

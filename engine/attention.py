"""Attention over the paged KV cache, plugged into the real transformers models.

transformers routes every attention layer of GPT-2 and Llama through its
``AttentionInterface``: we register ``paged_attention`` under
``ATTENTION_NAME``, switch a model to it with ``set_attn_implementation``, and
pass a ``PagedBatch`` as the keyword argument ``paged`` of the model call; the
library hands keyword arguments down to the attention function, and
``module.layer_idx`` says which layer's cache to use. No model code is copied.

A call is one of two shapes:

* prefill: one or more prompts packed into one row (varlen: positions restart
  at 0 for each prompt). Keys and values are written into each prompt's own
  blocks, and attention is causal within each prompt and never across prompts:
  one causal ``scaled_dot_product_attention`` per prompt, on exactly the shapes
  a prompt prefilled alone would see, so a packed prefill is bit for bit the
  solo one (a single call with a block-diagonal mask is not: the kernel then
  splits and accumulates each prompt's keys differently).
* decode: a batch of sequences, one new position each. The new keys and values
  are written first, then every sequence's positions are gathered through its
  block table into a padded tensor, and padding is masked out with -inf.

Because transformers finds no mask builder for this name, it builds no mask:
the ``PagedBatch`` carries what each call needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .kv_cache import PagedKVCache

ATTENTION_NAME = "streamscope_paged"


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Where one forward pass writes and reads in the cache (shared by every layer)."""

    cache: PagedKVCache
    write_slots: torch.Tensor  # (batch * new_positions,) slots for the new keys/values
    read_slots: torch.Tensor | None  # decode: (batch * max_len,) slots to gather; prefill: None
    read_bias: torch.Tensor | None  # decode: (batch, 1, 1, max_len) 0 where real, -inf padding
    prompt_lengths: tuple[int, ...] = ()  # prefill: the packed prompts' lengths, in order


def prefill_batch(
    cache: PagedKVCache, tables: torch.Tensor, lengths: list[int]
) -> tuple[PagedBatch, torch.Tensor]:
    """A packed prefill of ``len(lengths)`` prompts, and its position ids (1, total).

    ``tables`` (prompts, blocks) holds each prompt's block table, padded with any
    valid block id; prompt ``i`` occupies ``lengths[i]`` consecutive tokens of the row.
    """
    device = tables.device
    counts = torch.tensor(lengths, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    positions = torch.arange(int(counts.sum()), device=device) - starts
    blocks = tables[rows, torch.div(positions, cache.block_size, rounding_mode="floor")]
    slots = blocks * cache.block_size + positions % cache.block_size
    return PagedBatch(cache, slots, None, None, tuple(lengths)), positions.unsqueeze(0)


def decode_batch(
    cache: PagedKVCache, tables: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> PagedBatch:
    """A decode of ``positions`` (batch, 1), the newest position of each row.

    ``tables`` (batch, blocks) is padded with any valid block id: padded reads
    are masked out, and no row reads past its own length.
    """
    lengths = positions + 1
    span = torch.arange(int(lengths.max()), device=positions.device).expand(len(positions), -1)
    bias = torch.zeros(span.shape, dtype=dtype, device=positions.device)
    return PagedBatch(
        cache,
        write_slots=cache.slots(tables, positions).flatten(),
        read_slots=cache.slots(tables, span).flatten(),
        read_bias=bias.masked_fill_(span >= lengths, float("-inf"))[:, None, None, :],
    )


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Write this layer's new keys/values into the cache, then attend.

    Shapes follow the interface: query (batch, heads, new, head_dim), key and
    value (batch, kv_heads, new, head_dim); returns (batch, new, heads, head_dim).
    """
    if paged is None:
        raise RuntimeError("paged_attention needs the `paged` keyword argument")
    layer: int = module.layer_idx  # type: ignore[assignment]  # set by every attention layer
    k_cache, v_cache = paged.cache.keys[layer], paged.cache.values[layer]
    batch, num_heads, _, head_dim = query.shape
    num_kv_heads = key.shape[1]
    k_cache.index_copy_(
        0, paged.write_slots, key.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    )
    v_cache.index_copy_(
        0, paged.write_slots, value.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    )
    if paged.read_slots is None or paged.read_bias is None:
        return _packed_causal(query, key, value, paged.prompt_lengths, scaling), None
    # Decode: one new position per row. The query heads that share a kv head are
    # laid out as that kv head's "positions" (as transformers' pack_gqa does), so
    # grouped-query attention needs no copy of the keys per query head.
    max_len = paged.read_bias.shape[-1]
    shape = (batch, max_len, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, paged.read_slots).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, paged.read_slots).view(shape).transpose(1, 2)
    grouped = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, keys, values, attn_mask=paged.read_bias, scale=scaling
    )
    return out.reshape(batch, 1, num_heads, head_dim), None


def _packed_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: tuple[int, ...],
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention within each packed prompt.

    (1, heads, total, dim) in, (1, total, heads, dim) out.
    """
    gqa = query.shape[1] != key.shape[1]
    if len(lengths) <= 1:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous()
    parts = []
    start = 0
    for n in lengths:  # a contiguous copy per prompt: the solo call's exact inputs
        q, k, v = (x[:, :, start : start + n].contiguous() for x in (query, key, value))
        parts.append(
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        )
        start += n
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


AttentionInterface.register(ATTENTION_NAME, paged_attention)

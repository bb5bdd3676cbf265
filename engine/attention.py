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
  a prompt prefilled alone would see, so a packed prompt's hidden states are
  bit for bit its solo prefill's (a single call with a block-diagonal mask is
  not, and measures slower: ``python -m tools.bench prefill``). A prompt may come in
  chunks over several calls (chunked prefill): a chunk that starts at position
  ``p > 0`` attends to the ``p`` cached positions before it, read back through
  its block table, and causally within itself. Where the linear layers keep a
  row's result alone (``PagedBatch.rows_alone``: bfloat16 and int8 on a CPU),
  each row instead attends in a call of its own padded length
  (``PREFILL_PAD_TO``), so that where a prompt was cut changes none of its bits.
* decode: a batch of sequences, one new position each. The new keys and values
  are written first, then every sequence's positions are gathered through its
  block table into a padded tensor, and padding is masked out with -inf. A row is
  padded to the next multiple of ``PAD_TO`` of its OWN length, never to a batch
  mate's: the kernel's result differs in the last bits with the length a row is
  padded to, so padding that depends only on the row keeps its attention bit for
  bit what it is alone (in bfloat16 a last bit can flip a near-tie token). Rows
  of one padded length go in one gather and one kernel call (``length_groups``),
  so one long sequence does not make the short rows attend over its length.
* mixed (``mixed_batch``): a prefill's packed chunks, then decode rows, in ONE
  row, so that a step pays the model's per-pass cost once. Every position's keys
  and values are written first; the chunks attend as in a prefill, and the decode
  rows' queries are taken out and attend exactly as in a decode of those rows
  (the same gather, mask and kernel call), so only the linear layers see a
  different batch shape (see ``tools.bench prefill`` for what that changes).

Because transformers finds no mask builder for this name, it builds no mask:
the ``PagedBatch`` (``engine.paged_batch``: the builders and the padding rules)
carries what each call needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import PagedKVCache
from .offline import hub_offline
from .paged_batch import PagedBatch, ReadGroup, prefill_length

ATTENTION_NAME = "streamscope_paged"


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
    num_heads, head_dim = query.shape[1], query.shape[3]
    num_kv_heads = key.shape[1]
    k_cache.index_copy_(
        0, paged.write_slots, key.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    )
    v_cache.index_copy_(
        0, paged.write_slots, value.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    )
    prefill = _rows_alone if paged.rows_alone else _packed_causal
    if not paged.reads:
        return prefill(query, key, value, paged, layer, scaling), None
    if not paged.prompt_lengths:
        return _decode(query, paged, layer, scaling), None
    # Mixed: the packed chunks first, then one position per decode row.
    packed = sum(paged.prompt_lengths)
    q, k, v = (x[:, :, :packed] for x in (query, key, value))
    chunks = prefill(q, k, v, paged, layer, scaling)
    rows = query[0, :, packed:].transpose(0, 1).unsqueeze(2)  # (rows, heads, 1, dim)
    decoded = _decode(rows, paged, layer, scaling).reshape(1, -1, num_heads, head_dim)
    return torch.cat([chunks, decoded], dim=1), None


def _decode(
    query: torch.Tensor, paged: PagedBatch, layer: int, scaling: float | None
) -> torch.Tensor:
    """One new position per row, over the row's cached positions (the new one's keys
    already written). (rows, heads, 1, dim) in, (rows, 1, heads, dim) out.

    One gather and one kernel call per length group (``ReadGroup``). The query heads
    that share a kv head are laid out as that kv head's "positions" (as transformers'
    pack_gqa does), so grouped-query attention needs no copy of the keys per query head.
    """
    parts = [_attend_group(query if group.rows is None else query.index_select(0, group.rows),
                           group, paged.cache, layer, scaling) for group in paged.reads]
    if paged.order is None:
        return parts[0]
    return torch.cat(parts).index_select(0, paged.order)


def _attend_group(
    query: torch.Tensor, group: ReadGroup, cache: PagedKVCache, layer: int,
    scaling: float | None,
) -> torch.Tensor:
    k_cache, v_cache = cache.keys[layer], cache.values[layer]
    batch, num_heads, _, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    shape = (batch, group.bias.shape[-1], num_kv_heads, head_dim)
    keys = k_cache.index_select(0, group.slots).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, group.slots).view(shape).transpose(1, 2)
    grouped = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.bias, scale=scaling)
    return out.reshape(batch, 1, num_heads, head_dim)


def _packed_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    paged: PagedBatch,
    layer: int,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention within each packed chunk (and over its prompt's cached prefix).

    (1, heads, total, dim) in, (1, total, heads, dim) out.
    """
    gqa = query.shape[1] != key.shape[1]
    lengths, prefixes = paged.prompt_lengths, paged.prefix_slots
    if len(lengths) <= 1 and not any(p is not None for p in prefixes):
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous()
    parts = []
    start = 0
    for i, n in enumerate(lengths):  # a contiguous copy per prompt: the solo call's exact inputs
        q, k, v = (x[:, :, start : start + n].contiguous() for x in (query, key, value))
        prefix = prefixes[i] if prefixes else None
        if prefix is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:  # a later chunk: its keys (already written) and the cached ones before it
            k, v = (c[layer].index_select(0, prefix).transpose(0, 1)[None]
                    for c in (paged.cache.keys, paged.cache.values))
            seen = torch.arange(k.shape[2], device=q.device)
            mask = seen[None, :] <= seen[-n:, None]  # query i sits at position seen[-n + i]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa
            )
        parts.append(out)
        start += n
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _rows_alone(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    paged: PagedBatch,
    layer: int,
    scaling: float | None,
) -> torch.Tensor:
    """``_packed_causal``'s result, each row's independent of how its prompt was chunked.

    (1, heads, total, dim) in, (1, total, heads, dim) out. Each row attends over its
    prompt's positions up to its own, padded to ``prefill_length`` of its own length
    (padding masked out), in one call per chunk and padded length, the rows laid out as
    that call's query positions; the keys are read back from the cache (written above).
    A row's result thus depends on its prompt and position alone, not on where the prompt
    was cut into chunks (a step's budget, a prefix cache hit) or what was packed beside
    it: ``_packed_causal``'s one call over a chunk is not so (its kernel blocks the
    keys by the chunk's length, so a row's last bits depend on the cut). It costs more
    calls and masked positions, and is used where the linear layers keep a row's result
    alone too (``PagedBatch.rows_alone``): elsewhere a row's last bits depend on its
    batch anyway.
    """
    k_cache, v_cache = paged.cache.keys[layer], paged.cache.values[layer]
    num_heads, head_dim = query.shape[1], query.shape[3]
    num_kv_heads = k_cache.shape[1]
    per_kv = num_heads // num_kv_heads
    # (kv heads, total * per_kv, dim): a kv head's query heads, row after row
    queries = query[0].reshape(num_kv_heads, per_kv, -1, head_dim).transpose(1, 2)
    parts, offset = [], 0
    for i, n in enumerate(paged.prompt_lengths or (query.shape[2],)):  # none: one prompt
        prefix = paged.prefix_slots[i] if paged.prefix_slots else None
        slots = paged.write_slots[offset : offset + n] if prefix is None else prefix
        start, end = len(slots) - n, len(slots)
        span = torch.arange(prefill_length(end), device=slots.device)
        keys, values = (c.index_select(0, slots[span.clamp(max=end - 1)]).transpose(0, 1)[None]
                        for c in (k_cache, v_cache))  # (1, kv heads, padded end, dim)
        first = start
        while first < end:  # the rows of one padded length
            width = prefill_length(first + 1)
            last = min(width, end)
            own = torch.arange(first + 1, last + 1, device=slots.device)[:, None]
            bias = torch.zeros((last - first, width), dtype=query.dtype, device=query.device)
            bias.masked_fill_(span[:width] >= own, float("-inf"))
            rows = queries[:, offset + first - start : offset + last - start]
            out = F.scaled_dot_product_attention(
                rows.reshape(1, num_kv_heads, -1, head_dim), keys[:, :, :width],
                values[:, :, :width], attn_mask=bias.repeat_interleave(per_kv, 0)[None, None],
                scale=scaling)
            parts.append(out.reshape(num_kv_heads, last - first, per_kv, head_dim))
            first = last
        offset += n
    return torch.cat(parts, dim=1).transpose(0, 1).reshape(1, -1, num_heads, head_dim)


def register_paged_attention() -> None:
    """Make ``ATTENTION_NAME`` known to transformers (idempotent): before a model is
    switched to it. Done when a runner is made rather than at import, so that importing
    this module imports no transformers (see ``offline``)."""
    hub_offline()
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)

"""Attention over the paged KV cache, plugged into the real transformers models.

transformers routes every attention layer of GPT-2 and Llama through its
``AttentionInterface``: we register ``paged_attention`` under
``ATTENTION_NAME``, switch a model to it with ``set_attn_implementation``, and
pass a ``PagedBatch`` as the keyword argument ``paged`` of the model call; the
library hands keyword arguments down to the attention function, and
``module.layer_idx`` says which layer's cache to use. No model code is copied.

A call is one of two shapes:

* prefill: one sequence, all its prompt positions. Keys and values are written
  into the cache and attention is causal over the new positions themselves.
* decode: a batch of sequences, one new position each. The new keys and values
  are written first, then every sequence's positions are gathered through its
  block table into a padded tensor and masked to its own length.

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
    """Where one forward pass writes and reads in the cache."""

    cache: PagedKVCache
    write_slots: torch.Tensor  # (batch * new_positions,) slots for the new keys/values
    read_slots: torch.Tensor | None  # decode: (batch, max_len) slots to gather; prefill: None
    read_mask: torch.Tensor | None  # decode: (batch, 1, 1, max_len) True where a position is real


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
    layer = module.layer_idx
    k_cache, v_cache = paged.cache.keys[layer], paged.cache.values[layer]
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    k_cache[paged.write_slots] = key.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    v_cache[paged.write_slots] = value.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    gqa = query.shape[1] != num_kv_heads
    if paged.read_slots is None:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa
        )
    else:
        keys = k_cache[paged.read_slots].transpose(1, 2)  # (batch, kv_heads, max_len, head_dim)
        values = v_cache[paged.read_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=paged.read_mask, scale=scaling, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)

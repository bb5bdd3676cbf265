"""A Llama model's forward pass over the paged cache, without transformers' per-call layers.

At one row a decode step's matrix products are small (the int4 layers of the embedded
model take about 4 ms of a step), and the Python around them is not: transformers'
``LlamaForCausalLM`` call passes every layer through its decorators, output-capture
hooks, keyword plumbing and module ``__call__``s, a third of a one-row int4 step
(docs/results.md, "One stream"). ``LlamaPass`` runs the same computation from the same
modules' weights, op for op as transformers' Llama code writes it (the RMS norm in
float32 then the weight in the model's dtype, the rotary embedding as ``q * cos +
rotate_half(q) * sin``, SiLU-gated MLP), so its logits are transformers' bit for bit
(tests/test_llama_forward.py); only the calls around the ops are fewer:

* each module's ``forward`` is called directly (no ``__call__`` hooks);
* ``rotate_half(x) * sin`` is ``roll(x) * sin_signed`` (``cat(-x2, x1) * sin`` with the
  sign moved onto ``sin``, once a pass: a negation is exact, so the bits are the same);
* where a layer's query, key and value projections (and the MLP's gate and up ones) have
  been fused into one call (``engine.fused_linear``), the pass makes one call for them
  and the rotary embedding runs once over the query and key heads together.

The attention is ``engine.attention.paged_attention``, called as transformers calls it.
Models other than Llama keep transformers' own forward (``for_model`` returns None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .attention import paged_attention

if TYPE_CHECKING:
    from .paged_batch import PagedBatch


def for_model(model: Any) -> LlamaPass | None:
    """A ``LlamaPass`` over ``model`` if it is a Llama model whose layers this pass
    computes as transformers does (SiLU MLP, RMS norms); else None."""
    if type(model).__name__ != "LlamaForCausalLM":
        return None
    config = model.config
    if config.hidden_act != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return None
    return LlamaPass(model)


class LlamaPass:
    """``model(input_ids, position_ids=..., paged=..., logits_to_keep=...).logits``,
    with fewer calls (the module docstring)."""

    def __init__(self, model: Any) -> None:
        body = model.model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.layers = list(body.layers)
        self.norm = body.norm
        self.head = model.lm_head
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, paged: PagedBatch,
                 logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        hidden = self.embed.forward(input_ids)
        cos, sin = self.rotary.forward(hidden, position_ids)
        half = cos.shape[-1] // 2
        # (batch, new, 1, dim): broadcast over the heads of the (batch, new, heads, dim) rows
        cos = cos.unsqueeze(2)
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2)
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, paged)
        hidden = _rms_norm(self.norm, hidden)
        if isinstance(logits_to_keep, int):
            kept = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
        else:
            kept = hidden[:, logits_to_keep, :]
        logits: torch.Tensor = self.head.forward(kept)
        return logits

    def _layer(self, layer: Any, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, paged: PagedBatch) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        batch, new = hidden.shape[:2]
        x = _rms_norm(layer.input_layernorm, hidden)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        fused = getattr(attn, "qkv_proj", None)
        if fused is not None:
            qkv = fused.forward(x).view(batch, new, heads + 2 * kv_heads, dim)
            qk = _rotate(qkv[:, :, : heads + kv_heads], cos, sin)
            query, key = qk[:, :, :heads], qk[:, :, heads:]
            value = qkv[:, :, heads + kv_heads :]
        else:
            query = _rotate(attn.q_proj.forward(x).view(batch, new, heads, dim), cos, sin)
            key = _rotate(attn.k_proj.forward(x).view(batch, new, kv_heads, dim), cos, sin)
            value = attn.v_proj.forward(x).view(batch, new, kv_heads, dim)
        out, _ = paged_attention(attn, query.transpose(1, 2), key.transpose(1, 2),
                                 value.transpose(1, 2), None, scaling=attn.scaling, paged=paged)
        hidden = hidden + attn.o_proj.forward(out.reshape(batch, new, -1).contiguous())
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        gate_up = getattr(mlp, "gate_up_proj", None)
        if gate_up is not None:
            gate, up = gate_up.forward(x).chunk(2, dim=-1)
        else:
            gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
        return hidden + mlp.down_proj.forward(F.silu(gate) * up)


def _rms_norm(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, op for op."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    out: torch.Tensor = norm.weight * x.to(dtype)
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb``), bit
    for bit: ``rotate_half(x)`` is ``cat(-x2, x1)``, and ``roll(x)`` times ``sin`` with its
    first half negated gives the same products."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed

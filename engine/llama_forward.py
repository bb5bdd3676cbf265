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

* each layer's modules are looked up once, and each linear layer is called on the
  pass's 2-D rows directly (no ``__call__`` hooks, no reshaping around each call);
* ``rotate_half(x) * sin`` is ``roll(x) * sin_signed`` (``cat(-x2, x1) * sin`` with the
  sign moved onto ``sin``, once a pass: a negation is exact, so the bits are the same);
* where a layer's query, key and value projections (and the MLP's gate and up ones) have
  been fused into one call (``engine.fused_linear``), the pass makes one call for them
  and the rotary embedding runs once over the query and key heads together.

The attention is ``engine.attention.paged_attention``, called as transformers calls it.
A decode pass that ``engine.llama_decode`` computes (joined int4 layers, decode rows
only) runs its layers there instead: the same ops compiled by TorchScript, without Python.
Models other than Llama keep transformers' own forward (``for_model`` returns None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .attention import paged_attention
from .cpu_linear import _RowWise
from .llama_decode import ScriptedDecode

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
    with fewer calls (the module docstring). Each layer's modules are looked up once,
    here (``_Layer``), and its rows go through it as one 2-D (rows, hidden) tensor."""

    def __init__(self, model: Any) -> None:
        body = model.model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.layers = [_Layer.of(layer) for layer in body.layers]
        self.norm = (body.norm.weight, body.norm.variance_epsilon)
        self.head = model.lm_head
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        # the decode layers compiled (None where they do not apply); ``use_scripted``
        # False runs every pass through the Python layers (tools.bench onestream's A/B)
        self.scripted = ScriptedDecode.of(self.layers)
        self.use_scripted = True

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, paged: PagedBatch,
                 logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        embedded = self.embed.forward(input_ids)
        batch, new, width = embedded.shape
        cos, sin = self.rotary.forward(embedded, position_ids)
        half = cos.shape[-1] // 2
        # (rows, 1, dim): broadcast over the heads of the (rows, heads, dim) projections
        cos = cos.reshape(batch * new, 1, -1)
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).reshape(batch * new, 1, -1)
        hidden = embedded.view(batch * new, width)
        scripted = self.scripted
        if self.use_scripted and scripted is not None and scripted.fits(paged, batch, new):
            hidden = scripted(hidden, cos, sin, paged, self.num_heads, self.num_kv_heads,
                              self.head_dim)
        else:
            for layer in self.layers:
                hidden = self._layer(layer, hidden, cos, sin, paged, batch)
        hidden = _rms_norm(*self.norm, hidden).view(batch, new, width)
        if isinstance(logits_to_keep, int):
            kept = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
        else:
            kept = hidden[:, logits_to_keep, :]
        logits: torch.Tensor = self.head(kept)  # once a pass: its hooks run (tests' probes)
        return logits

    def _layer(self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, paged: PagedBatch, batch: int) -> torch.Tensor:
        """One decoder layer over ``hidden`` (rows, width): the rows of ``batch`` rows of
        ``rows / batch`` positions each."""
        rows = hidden.shape[0]
        new = rows // batch
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        x = _rms_norm(*layer.input_norm, hidden)
        if layer.qkv is not None:
            qkv = layer.qkv(x).view(rows, heads + 2 * kv_heads, dim)
            qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)
            query, key = qk[:, :heads], qk[:, heads:]
            value = qkv[:, heads + kv_heads :]
        else:
            query = _rotate(layer.q(x).view(rows, heads, dim), cos, sin)
            key = _rotate(layer.k(x).view(rows, kv_heads, dim), cos, sin)
            value = layer.v(x).view(rows, kv_heads, dim)
        out, _ = paged_attention(
            layer.attention, query.view(batch, new, heads, dim).transpose(1, 2),
            key.view(batch, new, kv_heads, dim).transpose(1, 2),
            value.view(batch, new, kv_heads, dim).transpose(1, 2), None,
            scaling=layer.scaling, paged=paged)
        hidden = hidden + layer.o(out.reshape(rows, -1).contiguous())
        x = _rms_norm(*layer.post_norm, hidden)
        if layer.gate_up is not None:
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = layer.gate(x), layer.up(x)
        return hidden + layer.down(F.silu(gate) * up)


Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Layer:
    """A decoder layer's weights and calls, looked up once (each linear layer's call on
    2-D rows: ``_RowWise._rows`` where it has no bias, else its ``forward``)."""

    attention: torch.nn.Module  # what paged_attention reads the layer's index from
    scaling: float
    input_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    qkv: Linear | None  # the joined projections (``fused_projections``), or None
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    gate_up: Linear | None
    gate: Linear
    up: Linear
    down: Linear

    @classmethod
    def of(cls, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        norms = [(n.weight, n.variance_epsilon)
                 for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        qkv, gate_up = getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)
        return cls(attn, attn.scaling, norms[0], norms[1],
                   None if qkv is None else _call(qkv), _call(attn.q_proj),
                   _call(attn.k_proj), _call(attn.v_proj), _call(attn.o_proj),
                   None if gate_up is None else _call(gate_up), _call(mlp.gate_proj),
                   _call(mlp.up_proj), _call(mlp.down_proj))


def _call(layer: torch.nn.Module) -> Linear:
    """How ``layer`` is called on 2-D rows, with the fewest Python calls around it."""
    if isinstance(layer, _RowWise) and layer.bias is None:
        return layer._rows
    forward: Linear = layer.forward
    return forward


def _rms_norm(weight: torch.Tensor, epsilon: float, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, op for op."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + epsilon)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb``), bit
    for bit: ``rotate_half(x)`` is ``cat(-x2, x1)``, and ``roll(x)`` times ``sin`` with its
    first half negated gives the same products."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed

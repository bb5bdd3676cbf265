"""A Llama decode step's decoder layers as one TorchScript function: the same ops, no Python.

At one row a decode step's small ops (the RMS norms, the rotary embedding, the residual
adds, SiLU times up, the cache's writes and gathers, the views between) cost more in
Python and in the dispatch from Python than in their kernels: about 600 of them a step on
the embedded model, 5 to 6 us each from ``engine.llama_forward``'s Python, most of a
one-row step's time outside the int4 layers (docs/results.md, "One stream").
``torch.jit.script`` compiles ``decode_layers`` (the loop over the layers, op for op
``LlamaPass._layer`` and ``engine.attention``'s decode of its read groups) into a graph
that TorchScript's interpreter runs without the Python interpreter: the same aten
operators on the same tensors in the same order, so the same bits
(tests/test_llama_decode.py checks the logits against the Python pass's, and
tests/test_llama_forward.py against transformers'). The interpreter also runs without
the GIL, so the server's event loop can route and write a token while a step runs.
Compiling takes about ten milliseconds, once a process; TorchScript profiles the first
call (tens of milliseconds more, once).

Nothing here fuses or reorders arithmetic: TorchScript fuses only where a fuser is on for
the device, and its CPU fusion is off unless switched on (``ScriptedDecode.of`` refuses
to run otherwise: a fused kernel could round differently).

Where it applies (``ScriptedDecode.fits``): a pass of decode rows only (no prompt
chunks), the layers' projections joined int4 layers (``engine.fused_projections``)
without biases, and no more rows than every layer takes in one kernel call (its
``rows_per_call``: larger batches are split by ``cpu_linear``, in Python), and every
layer taking a row alone (a ``min_rows_per_call`` of 2 pads it, in Python). Any other
pass runs ``LlamaPass``'s Python layers, which compute the same bits; a row's result
is thus the same whichever path its batch takes.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from .int4_linear import GROUP, Int4Linear

if TYPE_CHECKING:
    from .paged_batch import PagedBatch

logger = logging.getLogger(__name__)

# Per layer in ``weights``: the packed weight and the scales of qkv, o, gate_up, down.
# (TorchScript reads no global numbers: ``decode_layers`` and ``_int4`` write theirs out,
# and these say what they are.)
WEIGHTS_PER_LAYER = 8
INT4_GROUP = 32
assert INT4_GROUP == GROUP


def _rms_norm(weight: torch.Tensor, epsilon: float, hidden: torch.Tensor) -> torch.Tensor:
    """``llama_forward._rms_norm`` (transformers' ``LlamaRMSNorm``), op for op."""
    x = hidden.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + epsilon)
    return weight * x.to(hidden.dtype)


def _int4(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``Int4Linear._call``."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, 32, scales)  # INT4_GROUP


def _attend(grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            read_rows: list[torch.Tensor | None], read_slots: list[torch.Tensor],
            biases: list[torch.Tensor], order: torch.Tensor | None,
            scaling: float) -> torch.Tensor:
    """``engine.attention``'s ``_decode``: one gather and kernel call per read group
    (its rows of ``grouped`` (rows, kv heads, query heads per kv head, dim), None for all
    in order), the groups' rows back in batch order; (rows, heads * dim) out."""
    kv_heads, dim = keys.shape[1], keys.shape[2]
    parts: list[torch.Tensor] = []
    for g in range(len(read_slots)):
        rows_g = read_rows[g]
        query = grouped if rows_g is None else grouped.index_select(0, rows_g)
        shape = (query.shape[0], biases[g].shape[-1], kv_heads, dim)
        cached_keys = keys.index_select(0, read_slots[g]).view(shape).transpose(1, 2)
        cached_values = values.index_select(0, read_slots[g]).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, cached_keys, cached_values,
                                             attn_mask=biases[g], scale=scaling)
        parts.append(out.reshape(query.shape[0], -1))
    if order is None:
        return parts[0]
    return torch.cat(parts).index_select(0, order)


def decode_layers(hidden: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  norms: list[torch.Tensor], epsilons: list[float],
                  weights: list[torch.Tensor], scalings: list[float],
                  keys: list[torch.Tensor], values: list[torch.Tensor],
                  write_slots: torch.Tensor, read_rows: list[torch.Tensor | None],
                  read_slots: list[torch.Tensor], biases: list[torch.Tensor],
                  order: torch.Tensor | None, heads: int, kv_heads: int,
                  dim: int) -> torch.Tensor:
    """Every decoder layer over ``hidden`` (rows, width), one new position a row.

    ``LlamaPass._layer`` with joined int4 projections, and the attention of
    ``engine.attention.paged_attention`` for a decode: the new keys and values written
    at ``write_slots``, then per read group (``PagedBatch.reads``: its rows, the slots
    it gathers, its mask (rows, 1, 1, padded)) one gather and one kernel call, the
    query heads that share a kv head laid out as its positions, and the groups' rows put
    back in batch order (``order``). ``norms`` and ``epsilons`` hold each layer's input
    then post-attention norm; ``weights``, ``WEIGHTS_PER_LAYER`` a layer.
    """
    rows = hidden.shape[0]
    half = dim // 2
    for i in range(len(keys)):
        w = i * 8  # WEIGHTS_PER_LAYER
        x = _rms_norm(norms[2 * i], epsilons[2 * i], hidden)
        qkv = _int4(x, weights[w], weights[w + 1]).view(rows, heads + 2 * kv_heads, dim)
        qk = qkv[:, : heads + kv_heads]
        qk = qk * cos + qk.roll(half, dims=-1) * sin_signed
        keys[i].index_copy_(0, write_slots, qk[:, heads:])
        values[i].index_copy_(0, write_slots, qkv[:, heads + kv_heads:])
        grouped = qk[:, :heads].reshape(rows, kv_heads, heads // kv_heads, dim)
        out = _attend(grouped, keys[i], values[i], read_rows, read_slots, biases, order,
                      scalings[i])
        hidden = hidden + _int4(out.contiguous(), weights[w + 2], weights[w + 3])
        x = _rms_norm(norms[2 * i + 1], epsilons[2 * i + 1], hidden)
        gate, up = _int4(x, weights[w + 4], weights[w + 5]).chunk(2, dim=-1)
        hidden = hidden + _int4(F.silu(gate) * up, weights[w + 6], weights[w + 7])
    return hidden


class DecoderLayer(Protocol):
    """What ``ScriptedDecode.of`` reads of a layer (``llama_forward``'s ``_Layer``)."""

    @property
    def scaling(self) -> float: ...
    @property
    def input_norm(self) -> tuple[torch.Tensor, float]: ...
    @property
    def post_norm(self) -> tuple[torch.Tensor, float]: ...
    @property
    def qkv(self) -> Callable[[torch.Tensor], torch.Tensor] | None: ...
    @property
    def o(self) -> Callable[[torch.Tensor], torch.Tensor]: ...
    @property
    def gate_up(self) -> Callable[[torch.Tensor], torch.Tensor] | None: ...
    @property
    def down(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


@functools.cache
def _compiled() -> Any:
    """``decode_layers`` through ``torch.jit.script``, once a process. torch 2.13 (pinned)
    warns that TorchScript is deprecated for ``torch.compile``, whose inductor took 15 s
    to minutes to compile the decode forward at start, specialized per batch size and
    length groups, and changed the logits' last bits (docs/results.md, "torch.compile of
    the decode forward"), where this takes milliseconds and keeps them; the warning is
    for the future, the compiler works."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(decode_layers)


@dataclass(frozen=True)
class ScriptedDecode:
    """``decode_layers`` compiled, with a pass's weights laid out for it (``of``)."""

    script: Any  # torch.jit.ScriptFunction
    norms: list[torch.Tensor]
    epsilons: list[float]
    weights: list[torch.Tensor]
    scalings: list[float]
    linears: tuple[Int4Linear, ...]  # every layer's, for their rows_per_call

    @property
    def max_rows(self) -> int:
        """The fewest rows any layer takes in one call (``rows_per_call``, read now: a
        calibration may set it after the pass is made); more go through Python."""
        return min(linear.rows_per_call for linear in self.linears)

    @property
    def rows_alone(self) -> bool:
        """Whether every layer takes a row alone in a call of its own (its calibrated
        ``min_rows_per_call`` is 1): the compiled calls pad no rows, so a layer whose
        kernel computes a lone row by another path goes through Python's slicing."""
        return all(linear.min_rows_per_call == 1 for linear in self.linears)

    @classmethod
    def of(cls, layers: Sequence[DecoderLayer]) -> ScriptedDecode | None:
        """The compiled ``layers`` (a ``LlamaPass``'s), or None where they do not apply
        (projections not joined int4 layers, a bias) or TorchScript would fuse on the CPU."""
        if torch._C._jit_can_fuse_on_cpu():
            return None
        norms: list[torch.Tensor] = []
        epsilons: list[float] = []
        weights: list[torch.Tensor] = []
        linears: list[Int4Linear] = []
        for layer in layers:
            calls = (layer.qkv, layer.o, layer.gate_up, layer.down)
            owners = [getattr(call, "__self__", None) for call in calls]
            int4 = [owner for owner in owners if type(owner) is Int4Linear]
            if len(int4) != len(calls) or any(owner.bias is not None for owner in int4):
                return None
            linears += int4
            norms += [layer.input_norm[0], layer.post_norm[0]]
            epsilons += [layer.input_norm[1], layer.post_norm[1]]
            for owner in int4:
                weights += [owner.packed, owner.scales_zeros]
        try:
            script = _compiled()
        except Exception:  # a TorchScript that cannot compile it: the Python layers serve
            logger.warning("the decode layers could not be compiled", exc_info=True)
            return None
        return cls(script, norms, epsilons, weights,
                   [layer.scaling for layer in layers], tuple(linears))

    def fits(self, paged: PagedBatch, rows: int, new: int) -> bool:
        """Whether a pass of ``rows`` rows of ``new`` positions over ``paged`` is one
        this function computes (the module docstring)."""
        return (new == 1 and not paged.prompt_lengths and bool(paged.reads)
                and (rows == 1 or rows <= self.max_rows) and self.rows_alone)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                 paged: PagedBatch, heads: int, kv_heads: int, dim: int) -> torch.Tensor:
        reads = paged.reads
        result: torch.Tensor = self.script(
            hidden, cos, sin_signed, self.norms, self.epsilons, self.weights,
            self.scalings, paged.cache.keys, paged.cache.values, paged.write_slots,
            [group.rows for group in reads], [group.slots for group in reads],
            [group.bias for group in reads], paged.order, heads, kv_heads, dim)
        return result

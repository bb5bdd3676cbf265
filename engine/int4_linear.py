"""The ``int4`` precision's linear layers: the GGUF file's own Q4_1 blocks on torch's int4 kernel.

The embedded model ships as GGUF with its 210 linear layers in Q4_1: blocks of 32 weights
along the input dimension, each ``w = d*q + m`` with ``q`` in 0..15 and ``d``, ``m`` one
float16 pair per block. torch's own CPU int4 kernel (``_weight_int4pack_mm_for_cpu``, group
size 32, a scale and a zero per group: ``w = (q - 8)*scale + zero``) takes exactly that
form with ``scale = d`` and ``zero = m + 8d``. So ``int4`` reads the raw blocks with the
``gguf`` package and repacks them at load (``_convert_weight_to_int4pack_for_cpu``): the
file's own 4-bit numbers, no requantizing of float weights, no hand-written kernel. The
one rounding is the kernel's: it takes its scales and zeros in the activations' dtype,
bfloat16, where the file has float16 (within 2^-9 of each).

transformers' GGUF loader reverses llama.cpp's permutation of the query and key rows
(``LlamaTensorProcessor._reverse_permute_weights``) so that its rotary embedding sees
them in Hugging Face's order; the blocks run along the input dimension, so the same row
permutation applies to them whole (``_reverse_permute_rows``).
tests/test_int4_linear.py checks that the blocks dequantize to the loaded model's weights,
layer by layer.

A model without GGUF blocks (the tiny random test models, a local folder) gets the same
Q4_1 form made from its float weights (``q4_1_from_float``: min and max per group of 32),
so the tests cover ``int4`` with the tiny models; that path does requantize.

The output layer (tied to the embedding; Q8_0 in the file) stays in bfloat16
(``cpu_linear.PackedLinear``): measured, int8 weight-only is no faster at one row and
several times slower at 32 (docs/results.md, "int4"), and the Q8_0 blocks run exactly on
this kernel as two 4-bit halves saved a millisecond or two of a one-row step but cost
int4 a quarter of its speed at 32 rows and some agreement with float32 (docs/results.md,
"One stream": measured, not kept).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .cpu_linear import _RowWise, linear_weight

logger = logging.getLogger(__name__)

GROUP = 32  # weights per Q4_1 block, and the kernel's group size
INNER_K_TILES = 2  # the kernel's packing (what torch's own int4 tests use on a CPU)
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of two 4-bit values each

# GGUF's names for a Llama block's linear layers -> the transformers module's.
LLAMA_LAYERS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Q4_1:
    """One layer's blocks: ``q`` (out, in) in 0..15; ``d``, ``m`` (out, in / 32) float32."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the blocks stand for (as gguf and transformers compute it)."""
        out_features, in_features = self.q.shape
        grouped = self.q.reshape(out_features, -1, GROUP).float()
        return (grouped * self.d[..., None] + self.m[..., None]).reshape(out_features,
                                                                       in_features)


class Int4Linear(_RowWise):
    """A linear layer on torch's int4 CPU kernel, its weight as Q4_1 blocks; bfloat16 rows."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, blocks: Q4_1 | tuple[torch.Tensor, torch.Tensor],
                 bias: torch.Tensor | None = None) -> None:
        """``blocks``: the layer's Q4_1 blocks, or the kernel's (packed, scales_zeros)
        already made (``joined``)."""
        if isinstance(blocks, Q4_1):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                blocks.q.to(torch.int32).contiguous(), INNER_K_TILES)
            # (in / 32, out, 2): per group, the scale and the zero of w = (q - 8)*scale + zero.
            scales_zeros = torch.stack([blocks.d.t(), (blocks.m + 8 * blocks.d).t()], dim=-1)
        else:
            packed, scales_zeros = blocks
        out_features, in_features = scales_zeros.shape[1], scales_zeros.shape[0] * GROUP
        super().__init__(out_features, in_features,
                         None if bias is None else bias.to(torch.bfloat16))
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16).contiguous())

    @classmethod
    def joined(cls, parts: list[Int4Linear]) -> Int4Linear | None:
        """One layer giving every part's outputs side by side in one call (a Llama
        layer's query, key and value projections; its MLP's gate and up ones), or None
        where the kernel's packing does not let the parts' weights be laid end to end.

        The packed weights are concatenated along the outputs, the scales and zeros too,
        and each part's ``packed`` becomes a view into the joined one (no second copy).
        That torch's packing is blocked along the outputs (in blocks of 64 on this
        build) is not assumed: the joined layer must give the parts' outputs bit for bit
        on probe rows (``_gives_the_parts``), or the parts stay as they are."""
        if len({p.in_features for p in parts}) != 1 or (
                len({p.bias is None for p in parts}) != 1):
            return None
        biases: list[torch.Tensor] = [p.bias for p in parts if p.bias is not None]
        joined = cls((torch.cat([p.packed for p in parts]),
                      torch.cat([p.scales_zeros for p in parts], dim=1)),
                     torch.cat(biases) if biases else None)
        if not _gives_the_parts(joined, parts):
            return None
        views = joined.packed.split([p.packed.shape[0] for p in parts])
        for part, view in zip(parts, views, strict=True):
            part.packed = view
        return joined

    @classmethod
    def from_float(cls, layer: torch.nn.Module) -> Int4Linear:
        """``layer`` (``nn.Linear`` or ``Conv1D``) quantized into Q4_1 blocks first."""
        weight, bias = linear_weight(layer)
        return cls(q4_1_from_float(weight), bias)

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, GROUP, self.scales_zeros)


def _gives_the_parts(joined: Int4Linear, parts: list[Int4Linear], rows: int = 3) -> bool:
    """Whether ``joined`` gives, on seeded random rows, each part's outputs bit for bit."""
    generator = torch.Generator().manual_seed(GROUP)
    x = torch.randn(rows, joined.in_features, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        return torch.equal(joined._call(x), torch.cat([p._call(x) for p in parts], dim=-1))


def fits(layer: torch.nn.Module) -> bool:
    """Whether the int4 kernel takes ``layer``'s shape (an input a multiple of 32)."""
    return linear_weight(layer)[0].shape[1] % GROUP == 0


def q4_1_from_float(weight: torch.Tensor) -> Q4_1:
    """Q4_1 blocks for a float weight (out, in): per group of 32, ``m`` its minimum and
    ``d`` a fifteenth of its range (llama.cpp's ``quantize_row_q4_1``, unrounded d, m)."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    d = (high - low) / 15
    step = torch.where(d > 0, d, torch.ones_like(d))
    q = ((grouped - low[..., None]) / step[..., None]).round().clamp(0, 15)
    return Q4_1(q.to(torch.uint8).reshape(out_features, in_features), d, low)


def q4_1_from_gguf(data: Any) -> Q4_1:
    """A GGUF Q4_1 tensor's raw bytes (out, in / 32 * 20) as blocks: per block d and m
    (float16), then 16 bytes whose low nibbles are weights 0..15, high nibbles 16..31."""
    raw = torch.tensor(data, dtype=torch.uint8)  # a copy of gguf's numpy (memory-mapped)
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
    return Q4_1(q.reshape(out_features, -1).contiguous(), d, m)


def gguf_layers(
    path: Path, num_heads: int, num_kv_heads: int, keep: Path | None = None
) -> dict[str, Q4_1]:
    """A Llama GGUF file's Q4_1 linear layers, by the transformers module's name
    (``model.layers.3.mlp.up_proj``), query and key rows in transformers' order.

    Reading the file takes seconds (``GGUFReader`` parses its whole vocabulary first), so
    with ``keep`` (a file in the embedded model's converted copy, which is keyed by the
    GGUF file's size and mtime) the blocks are kept there in safetensors, as read, and a
    later start reads them from it instead (best effort: a file that cannot be read or
    written only costs the start its time)."""
    if keep is not None:
        kept = _read_kept(keep)
        if kept:
            return kept
    layers = _read_gguf(path, num_heads, num_kv_heads)
    if keep is not None:
        _write_kept(layers, keep)
    return layers


def _read_kept(keep: Path) -> dict[str, Q4_1]:
    import safetensors.torch

    try:
        tensors = safetensors.torch.load_file(str(keep))
    except (OSError, ValueError, RuntimeError):
        return {}
    names = {key.rsplit(".", 1)[0] for key in tensors}
    return {name: Q4_1(_unpack_nibbles(tensors[f"{name}.q"]), tensors[f"{name}.d"],
                       tensors[f"{name}.m"]) for name in names}


def _write_kept(layers: dict[str, Q4_1], keep: Path) -> None:
    import safetensors.torch

    tensors: dict[str, torch.Tensor] = {}
    for name, blocks in layers.items():
        tensors.update({f"{name}.q": blocks.q[:, 0::2] | (blocks.q[:, 1::2] << 4),
                        f"{name}.d": blocks.d, f"{name}.m": blocks.m})
    scratch = keep.with_name(keep.name + ".tmp")
    try:
        keep.parent.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(tensors, str(scratch))
        os.replace(scratch, keep)
    except OSError as exc:
        logger.warning("could not keep the int4 blocks in %s: %s", keep, exc)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(out, in / 2) bytes, two weights each (even index low) -> (out, in)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _read_gguf(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Q4_1]:
    from gguf import GGMLQuantizationType, GGUFReader  # only for a GGUF model's int4

    reader = GGUFReader(str(path))
    layers: dict[str, Q4_1] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")  # blk.3.ffn_up.weight
        if (tensor.tensor_type != GGMLQuantizationType.Q4_1 or len(parts) != 4
                or parts[0] != "blk" or parts[2] not in LLAMA_LAYERS):
            continue
        blocks = q4_1_from_gguf(tensor.data)
        if parts[2] in ("attn_q", "attn_k"):
            heads = num_heads if parts[2] == "attn_q" else num_kv_heads
            order = _reverse_permute_rows(blocks.q.shape[0], heads)
            blocks = Q4_1(blocks.q[order], blocks.d[order], blocks.m[order])
        layers[f"model.layers.{parts[1]}.{LLAMA_LAYERS[parts[2]]}"] = blocks
    return layers


def _reverse_permute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a GGUF query (key) weight: row r of its weight is
    row ``order[r]`` of the file's (``_reverse_permute_weights`` applied to row numbers)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)

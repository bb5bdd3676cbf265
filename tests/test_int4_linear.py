"""The int4 precision's layers (``engine.int4_linear``): the GGUF file's Q4_1 blocks read as
they are, put in the order transformers loads the model in, and run by torch's int4 kernel.

The block layout is checked against the ``gguf`` package's own quantizer and dequantizer,
the query/key row order against transformers' own reverse permutation, and, on the
embedded model (``smoke``: it loads SmolLM2), every one of the 210 layers' blocks against
the weights transformers loaded from the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from engine.cpu_linear import PackedLinear, _RowWise
from engine.int4_linear import (
    Q4_1,
    Int4Linear,
    _reverse_permute_rows,
    gguf_layers,
    q4_1_from_float,
    q4_1_from_gguf,
)
from engine.model import load_model, smollm2_path


def _gguf_q4_1(weight: np.ndarray) -> np.ndarray:
    return quants.quantize(weight, GGMLQuantizationType.Q4_1)


def test_the_raw_blocks_dequantize_as_gguf_does() -> None:
    weight = np.random.default_rng(0).normal(0, 0.05, (24, 96)).astype(np.float32)
    raw = _gguf_q4_1(weight)

    blocks = q4_1_from_gguf(raw)

    assert blocks.q.shape == (24, 96) and int(blocks.q.max()) <= 15
    assert torch.equal(blocks.dequantize(),
                       torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1)))


def test_the_kernel_computes_with_the_blocks_weight() -> None:
    weight = np.random.default_rng(1).normal(0, 0.05, (48, 64)).astype(np.float32)
    blocks = q4_1_from_gguf(_gguf_q4_1(weight))
    layer = Int4Linear(blocks)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    with torch.inference_mode():
        got = layer(x).float()
    expected = x.float() @ blocks.dequantize().t()
    # bfloat16 scales and zeros, bfloat16 output: a few parts in a thousand
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 0.01


def test_joined_int4_layers_give_their_parts_outputs_and_share_their_weights() -> None:
    generator = torch.Generator().manual_seed(6)
    parts = [Int4Linear(q4_1_from_float(torch.randn(n, 64, generator=generator)))
             for n in (128, 64, 64)]
    x = torch.randn(7, 64, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([part(x) for part in parts], dim=-1)

    joined = Int4Linear.joined(parts)

    assert joined is not None and (joined.out_features, joined.in_features) == (256, 64)
    with torch.inference_mode():
        assert torch.equal(joined(x), alone)
        assert torch.equal(torch.cat([part(x) for part in parts], dim=-1), alone)
    assert {p.packed.untyped_storage().data_ptr() for p in parts} == {
        joined.packed.untyped_storage().data_ptr()}


def test_query_and_key_rows_follow_transformers_reverse_permutation() -> None:
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9,
                                             "num_key_value_heads": 3})
    for heads, rows in ((9, 576), (3, 192)):
        expected = processor._reverse_permute_weights(np.arange(rows), 9, heads)
        assert _reverse_permute_rows(rows, heads).tolist() == expected.tolist()


def test_float_weights_are_put_in_q4_1_form_by_min_and_max() -> None:
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))

    blocks = q4_1_from_float(weight)

    grouped = weight.reshape(8, 2, 32)
    assert torch.equal(blocks.m, grouped.amin(-1))
    assert torch.equal(blocks.d, (grouped.amax(-1) - grouped.amin(-1)) / 15)
    assert (blocks.dequantize() - weight).abs().max() <= blocks.d.max() / 2 + 1e-6


@pytest.mark.smoke
def test_every_linear_layer_of_the_embedded_model_is_the_files_own_blocks(
    tmp_path: Path,
) -> None:
    model = load_model("smollm2", "cpu").model  # float32: transformers' dequantized weights
    config = model.config
    heads = (config.num_attention_heads, config.num_key_value_heads)
    keep = tmp_path / "blocks.safetensors"
    layers = gguf_layers(smollm2_path(), *heads, keep)
    weights = dict(model.named_parameters())

    assert len(layers) == 210
    for name, blocks in layers.items():
        assert isinstance(blocks, Q4_1)
        assert torch.equal(blocks.dequantize(), weights[f"{name}.weight"]), name
    kept = gguf_layers(tmp_path / "no-such.gguf", *heads, keep)  # a later start reads these
    assert kept.keys() == layers.keys()
    for name, blocks in layers.items():
        assert all(torch.equal(getattr(kept[name], f), getattr(blocks, f)) for f in "qdm")


@pytest.mark.smoke
def test_the_embedded_model_in_int4_runs_the_files_blocks_and_answers() -> None:
    from engine import GenerationRequest, TokenEvent
    from engine.engine import Engine

    loaded = load_model("smollm2", "cpu", precision="int4")
    layers = {name: m for name, m in loaded.model.named_modules() if isinstance(m, _RowWise)}
    joined = [name for name in layers if name.endswith(("qkv_proj", "gate_up_proj"))]

    assert [type(m) for m in layers.values()].count(Int4Linear) == 210 + len(joined)
    assert len(joined) == 2 * 30  # each layer's q/k/v and gate/up (engine.fused_projections)
    assert isinstance(loaded.model.get_output_embeddings(), PackedLinear)
    engine = Engine(loaded, max_batch=2, num_blocks=16, block_size=16)
    engine.submit(GenerationRequest("capital", "The capital of France is", 8))
    events = []
    while engine.has_work():
        events += engine.step()
    assert "Paris" in "".join(e.text for e in events if isinstance(e, TokenEvent))

"""The CPU's linear layers (``engine.cpu_linear``, ``engine.int4_linear``): once
calibrated on this CPU (``engine.batch_invariance``), a row's output is its solo output in
a batch of any size, bit for bit, and close to float32's.

The shapes are the embedded model's (SmolLM2-135M: 576 wide, 3 key/value heads of 64,
an MLP of 1,536, a vocabulary of 49,152), with random weights: the batch sizes that
matter are around the calibrated call size (whatever this CPU's is: 32 on a Xeon with
AMX; on an AMD EPYC the 1,536-to-576 bfloat16 layer computes a row alone by another path,
so its calls take two rows at least), and a prefill's hundreds of rows. No test assumes a
CPU's figure.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from engine.batch_invariance import calibrate
from engine.cpu_linear import (
    Int8Linear,
    PackedLinear,
    _RowWise,
    swap_linears,
)
from engine.int4_linear import Int4Linear

SHAPES = [(192, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (out, in)
Make = Callable[[torch.nn.Module], _RowWise]
LAYERS = pytest.mark.parametrize("make", [PackedLinear, Int8Linear, Int4Linear.from_float],
                                 ids=["bf16", "int8", "int4"])


def _linear(out_features: int, in_features: int, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(out_features + in_features)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    torch.nn.init.normal_(layer.weight, std=0.05)
    return layer.eval()


@LAYERS
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_a_row_gets_its_solo_output_in_every_batch(
    make: Make, out_features: int, in_features: int,
) -> None:
    layer = make(_linear(out_features, in_features))
    ((fewest, limit),) = calibrate([layer], "test").values()  # on other rows than these
    assert layer.rows_per_call == limit >= 1 and layer.min_rows_per_call == fewest
    counts = sorted({2, limit, limit + 1, 2 * limit + 1, 100, 300})
    rows = torch.randn(max(counts), in_features, generator=torch.Generator().manual_seed(3))
    rows = rows.to(torch.bfloat16)
    with torch.inference_mode():
        solo = torch.cat([layer(rows[i : i + 1]) for i in range(len(rows))])
        for count in counts:
            batch = layer(rows[:count])
            assert torch.equal(batch, solo[:count]), f"{count} rows"
            packed_row = layer(rows[:count][None])[0]  # (1, rows, in): a packed prefill's shape
            assert torch.equal(packed_row, solo[:count])


@LAYERS
def test_the_output_is_the_float32_layers_within_the_precisions_error(
    make: Make,
) -> None:
    plain = _linear(1536, 576, bias=True)
    layer = make(plain)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected, got = plain(x), layer(x.to(torch.bfloat16)).float()
    assert got.dtype == torch.float32 and layer.bias is not None
    error = (got - expected).abs().max() / expected.abs().max()
    # int4 is the float weights put in Q4_1 form here (min/max per 32): 16 levels a group.
    assert error < {"PackedLinear": 0.01, "Int8Linear": 0.02, "Int4Linear": 0.15}[
        type(layer).__name__]


@LAYERS
def test_gpt2s_conv1d_is_read_transposed(make: Make) -> None:
    torch.manual_seed(5)
    conv = Conv1D(48, 32)  # (in 32, out 48): x @ weight + bias
    torch.nn.init.normal_(conv.weight, std=0.1)
    torch.nn.init.normal_(conv.bias, std=0.1)
    x = torch.randn(3, 7, 32)
    layer = make(conv)
    with torch.inference_mode():
        expected, got = conv(x), layer(x.to(torch.bfloat16)).float()
    assert got.shape == (3, 7, 48)
    atol = 0.3 if isinstance(layer, Int4Linear) else 0.05  # 16 levels per group of 32
    torch.testing.assert_close(got, expected, atol=atol, rtol=0.05)


def test_swap_replaces_every_linear_layer_and_nothing_else() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Sequential(Conv1D(4, 8)), torch.nn.LayerNorm(4))
    assert swap_linears(model, Int8Linear) == 2
    assert [type(m).__name__ for m in model.modules()] == [
        "Sequential", "Int8Linear", "ReLU", "Sequential", "Int8Linear", "LayerNorm"]

"""Linear layers on the CPU's own kernels, each row's result the same in any batch.

``engine.precision`` swaps a model's linear layers for one of these (GPT-2's ``Conv1D``
too: its weight is stored transposed). Both keep one promise the identity tests rely on:
a row's output is bit for bit the same whether it is computed alone or among other rows,
so a concurrent answer equals its solo run.

* ``PackedLinear`` (bfloat16): torch's ``nn.Linear`` hands oneDNN the weight in torch's
  layout on every call, and oneDNN reorders it into its blocked (AMX / AVX-512) layout
  each time; at one row the reorder is most of the call. Here the weight is reordered
  once, at load (``torch.ops.mkldnn._reorder_linear_weight``, the op inductor's CPU
  weight freezing uses), and each call is ``torch.ops.mkldnn._linear_pointwise``: half
  the time of ``nn.Linear`` at one row (``python -m tools.bench step``). oneDNN picks its
  blocking by the number of rows, and measured on a Xeon with AMX a row's result is its
  solo result in any call of up to 32 rows but may differ in a last bit in a larger one
  (a 192x576 layer at 33 rows; this is also why plain bfloat16 broke the identity). On
  an AMD EPYC without AMX (AVX-512 BF16) it is the other end: the 1,536-to-576 layer
  computes a row alone by another path than any call of 2 to 256 rows, which all agree
  (about one random row in eleven gets different last bits alone). So the call sizes
  are not assumed: ``engine.batch_invariance`` measures them at load, per layer shape,
  on the CPU it runs on; a call with more rows than ``rows_per_call`` runs in slices of
  it, and one with fewer than ``min_rows_per_call`` (1 or 2) is padded with zero rows up
  to it, so that a row alone takes the same path as a row among others.
* ``Int8Linear`` (int8): weight-only int8, one scale per output channel, computed by
  torch's own quantizer (``PerChannelMinMaxObserver``, ``quantize_per_channel``), and
  torch's CPU kernel ``_weight_int8pack_mm`` (bfloat16 activations in and out): a
  quarter of float32's weight bytes; its rows calibrated like the others. Activations
  are never quantized (torch's dynamic quantization does that per batch, which ties a
  row to its batch mates).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.ao.quantization.observer import PerChannelMinMaxObserver


def packing_available() -> bool:
    """Whether this torch build has the oneDNN ops ``PackedLinear`` calls."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear_weight(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (out, in), bias) of an ``nn.Linear`` or a GPT-2 ``Conv1D`` (in, out)."""
    weight, bias = layer.weight, getattr(layer, "bias", None)
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    if not isinstance(layer, torch.nn.Linear):  # Conv1D: x @ weight + bias
        weight = weight.t()
    return weight.detach().contiguous(), None if bias is None else bias.detach()


class _RowWise(torch.nn.Module):
    """Flattens the leading dimensions to rows, runs them through ``_call`` in calls of
    ``min_rows_per_call`` to ``rows_per_call`` rows (``_sliced``), adds the bias.

    Both start at 1 (a row alone: its solo result by definition, if the kernel is
    deterministic) until ``engine.batch_invariance.calibrate`` measures which call sizes
    the kernel keeps each row's bits in, for this layer's shape, on this CPU.
    """

    min_rows_per_call: int = 1
    rows_per_call: int = 1

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._rows(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self._sliced(rows, self.min_rows_per_call, self.rows_per_call)

    def _sliced(self, rows: torch.Tensor, fewest: int, most: int) -> torch.Tensor:
        """``rows`` (2-D) through the kernel in calls of ``fewest`` to ``most`` rows: sliced
        into calls of ``most``, a call short of ``fewest`` padded with zero rows (their
        outputs dropped). The calibration measures a size pair with this very function."""
        if fewest <= len(rows) <= most:
            return self._call(rows)
        if len(rows) < fewest:
            padding = rows.new_zeros(fewest - len(rows), rows.shape[1])
            return self._call(torch.cat([rows, padding]))[: len(rows)]
        return torch.cat([self._sliced(part, fewest, most) for part in rows.split(most)])

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel on one call's rows (2-D, ``min_rows_per_call`` to ``rows_per_call``)."""
        raise NotImplementedError


class PackedLinear(_RowWise):
    """A bfloat16 linear layer with its weight packed for oneDNN once."""

    packed: torch.Tensor

    def __init__(self, layer: torch.nn.Module) -> None:
        weight, bias = linear_weight(layer)
        super().__init__(weight.shape[0], weight.shape[1],
                         None if bias is None else bias.to(torch.bfloat16))
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), None)
        self.register_buffer("packed", packed, persistent=False)

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")


class Int8Linear(_RowWise):
    """A linear layer with int8 weights (a scale per output channel), bfloat16 rows."""

    weight_int8: torch.Tensor
    scales: torch.Tensor

    def __init__(self, layer: torch.nn.Module) -> None:
        weight, bias = linear_weight(layer)
        super().__init__(weight.shape[0], weight.shape[1],
                         None if bias is None else bias.to(torch.bfloat16))
        observer = PerChannelMinMaxObserver(
            ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        observer(weight.float())
        scales, zero_points = observer.calculate_qparams()
        with warnings.catch_warnings():  # deprecated for torchao (pytorch/pytorch#184982);
            warnings.simplefilter("ignore", UserWarning)  # still torch's own in 2.13 (pinned)
            quantized = torch.quantize_per_channel(
                weight.float(), scales, zero_points, 0, torch.qint8)
        self.register_buffer("weight_int8", quantized.int_repr())
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.weight_int8, self.scales)


def rows_alone(model: torch.nn.Module) -> bool:
    """Whether ``model``'s linear layers are these (a row's result the same in any batch)."""
    return any(isinstance(module, _RowWise) for module in model.modules())


def swap_linears(
    model: torch.nn.Module, make: Callable[[torch.nn.Module], _RowWise],
    before: Callable[[list[_RowWise]], object] | None = None,
) -> int:
    """Replace every ``nn.Linear`` and ``Conv1D`` of ``model`` by ``make(layer)``;
    returns how many. ``before`` sees the new layers first (``engine.batch_invariance``'s
    calibration): if it raises, ``model`` is left as it was."""
    swaps = [(parent, name, make(child)) for parent in list(model.modules())
             for name, child in list(parent.named_children())
             if isinstance(child, torch.nn.Linear) or type(child).__name__ == "Conv1D"]
    if before is not None:
        before([layer for _, _, layer in swaps])
    for parent, name, layer in swaps:
        setattr(parent, name, layer)
    return len(swaps)

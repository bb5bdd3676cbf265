"""The weights' precision: float32, bfloat16, int8 or int4.

One setting chooses it (``STREAMSCOPE_DTYPE`` in the app, ``precision`` here), among
``PRECISIONS``; ``python -m tools.lab precision`` measures each one's speed, its
concurrent-against-solo identity and its agreement with float32 (docs/results.md):

* ``float32``: the weights as loaded (the embedded model's GGUF dequantized to
  float32); the default where the CPU has no native bfloat16, and on a GPU.
* ``bfloat16``: every weight in bfloat16; the model computes in bfloat16 and the KV
  cache, which follows the model's dtype (``kv_cache``), holds bfloat16: half the
  memory per cached position. On a CPU the linear layers are ``cpu_linear.PackedLinear``
  (oneDNN's packed weights). On a CPU without native bf16 (AVX-512 BF16 or AMX) torch
  emulates it, slower.
* ``int8`` (CPU only): the linear layers' weights in int8 with a scale per output
  channel (``cpu_linear.Int8Linear``, torch's own quantizer and kernel), everything
  else as in bfloat16: a quarter of float32's weight bytes.
* ``int4`` (CPU only): the linear layers on torch's int4 kernel with the GGUF file's own
  Q4_1 blocks (``int4_linear``; a model without them gets its float weights put in that
  form; a Llama layer's q/k/v and gate/up joined, ``fused_projections``), the output
  layer and embedding in bfloat16, the KV cache bfloat16: the fastest at one stream, and
  ``auto``'s choice on a CPU with AMX (``default_precision``).

On a CPU, every precision but float32 runs its linear layers a row at a time as far as
the bits go: ``batch_invariance`` measures at load, per layer shape, how many rows a call
may take with every row keeping its solo bits, on the CPU it runs on. A precision whose
kernel has no such size is refused (``PrecisionError``) before the model is changed.

``default_precision`` is what ``auto`` (the app's default) tries first on a device, and
``auto_candidates`` the order it falls back in when a candidate is refused.

A precision the device cannot run raises ``PrecisionError`` before anything is built;
the app names its setting in the message.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import batch_invariance, cpu_linear, fused_projections, int4_linear
from .errors import PrecisionError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Each batch-invariant (tests/test_engine_identity.py runs every one).
PRECISIONS = ("float32", "bfloat16", "int8", "int4")
CPU_ONLY = ("int8", "int4")  # torch's weight-only kernels: CPU ones


def _cpu_flags() -> list[str]:
    """``/proc/cpuinfo``'s flags (torch's capability string does not name these)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return next((line.split(":", 1)[1].split() for line in text.splitlines()
                 if line.startswith("flags")), [])


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX-BF16)."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def amx_cpu() -> bool:
    """Whether this CPU has AMX tiles (AMX-BF16): the kind int4 was measured on to serve
    both one stream and 32 within issue 44's targets (``default_precision``)."""
    return "amx_bf16" in _cpu_flags()


def default_precision(device: torch.device) -> str:
    """What ``auto`` tries first: int4 on a CPU with AMX, bfloat16 on another CPU that
    computes it natively, float32 elsewhere (a GPU's bfloat16 is not measured here).

    Issue 44's rule: the precision that reaches both of its targets (one stream at least
    0.8x ``llama-server``'s tokens/s, 32 streams at least 2x, TTFT p99 at 32 no worse)
    where one does, else the one that serves 32 best. Measured side by side
    (docs/results.md, "One stream"), on this project's Xeon with AMX, int4 with its
    compiled decode layers reaches both (one stream 0.99x, 32 streams 2.45x, TTFT p99
    0.13x) where bfloat16 does not (0.40x at one stream; 3.59x at 32). On an AMD EPYC
    without AMX (AVX-512 BF16) neither reaches both (docs/results.md, "On an AMD
    EPYC"): int4 serves one stream best (0.74x, 7 alternated rounds) and bfloat16 32 streams
    (1.12-1.23x int4's tokens/s in the same runs, 2.41x ``llama-server``'s), so
    bfloat16 it is there, exact with its lone rows padded to two (``batch_invariance``)."""
    if device.type != "cpu":
        return "float32"
    if amx_cpu():
        return "int4"
    if native_bf16_cpu() and cpu_linear.packing_available():
        return "bfloat16"
    return "float32"


def auto_candidates(device: torch.device) -> list[str]:
    """``auto``'s order: ``default_precision`` first, then, should calibration refuse it
    on this CPU (``batch_invariance``), the others by speed at 32 rows, float32 last (its
    layers are not sliced: nothing to refuse)."""
    first = default_precision(device)
    if first == "int4":
        return ["int4", "bfloat16", "int8", "float32"]
    if first == "bfloat16":
        return ["bfloat16", "int4", "int8", "float32"]
    return [first]


def check(precision: str, device: torch.device) -> None:
    """Raise ``PrecisionError`` if ``device`` cannot run ``precision``."""
    if precision not in PRECISIONS:
        raise PrecisionError(
            f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if precision in CPU_ONLY and device.type != "cpu":
        raise PrecisionError(
            f"{precision} runs on the CPU only (torch's {precision} weight kernel), not {device}")
    if precision == "bfloat16" and device.type == "cuda" and not (
            torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        raise PrecisionError(f"bfloat16 needs a GPU that computes it; {device} does not")


def apply(
    model: PreTrainedModel, precision: str, gguf_file: Path | None = None,
    keep: Path | None = None,
) -> PreTrainedModel:
    """``model`` (float32, on its device, in eval mode) in ``precision``; ``check`` first.
    ``gguf_file``: the file ``model`` was loaded from (``int4`` repacks its Q4_1 blocks;
    ``keep``: where they are kept for the next start, ``int4_linear.gguf_layers``).
    Raises ``PrecisionError`` (``model`` unchanged) if calibration finds no exact call size."""
    # The linear layers are made from the float32 weights (quantized or packed), then the
    # rest (embeddings, norms) is cast: no bfloat16 copy of the whole model in between.
    make = _layer_maker(model, precision, gguf_file, keep)
    if make is not None:
        cpu_linear.swap_linears(model, make, before=lambda layers: batch_invariance.calibrate(
            layers, precision))
    if precision == "int4":  # a Llama layer's q/k/v and gate/up in one call each
        fused_projections.join_llama_projections(model, precision)
    if precision != "float32":
        model = model.to(dtype=torch.bfloat16)  # type: ignore[call-arg]
        _return_freed_memory()
    return model


def _layer_maker(
    model: PreTrainedModel, precision: str, gguf_file: Path | None, keep: Path | None
) -> Callable[[torch.nn.Module], cpu_linear._RowWise] | None:
    """How ``precision`` makes each linear layer, or None (the layers stay as they are)."""
    if precision == "int8":
        return cpu_linear.Int8Linear
    packing = model.device.type == "cpu" and cpu_linear.packing_available()
    if precision == "bfloat16":
        return cpu_linear.PackedLinear if packing else None
    if precision != "int4":
        return None
    config = model.config
    blocks = {} if gguf_file is None else int4_linear.gguf_layers(
        gguf_file, config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads, keep)
    names = {id(module): name for name, module in model.named_modules()}
    head = model.get_output_embeddings()
    other = cpu_linear.PackedLinear if packing else cpu_linear.Int8Linear

    def make(layer: torch.nn.Module) -> cpu_linear._RowWise:
        name = names[id(layer)]
        if name in blocks:
            _, bias = cpu_linear.linear_weight(layer)
            return int4_linear.Int4Linear(blocks.pop(name), bias)
        if layer is head or not int4_linear.fits(layer):
            return other(layer)  # the output layer: bfloat16 (int4_linear's docstring)
        return int4_linear.Int4Linear.from_float(layer)

    return make


def _return_freed_memory() -> None:
    """Hand the float32 weights' freed pages back to the system: glibc keeps freed heap
    memory for reuse, and after the conversion that is about 100 MB of the embedded
    model's idle RSS that nothing reuses (``malloc_trim``; not glibc: nothing to do)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)

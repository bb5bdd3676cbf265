"""The weights' precision: float32, bfloat16 or int8.

One setting chooses it (``STREAMSCOPE_DTYPE`` in the app, ``precision`` here), among
``PRECISIONS``; ``python -m tools.lab precision`` measures each one's speed, its
concurrent-against-solo identity and its agreement with float32 (docs/results.md):

* ``float32``: the weights as loaded (the embedded model's GGUF dequantized to
  float32); the default where the CPU has no native bfloat16, and on a GPU.
* ``bfloat16``: every weight in bfloat16; the model computes in bfloat16 and the KV
  cache, which follows the model's dtype (``kv_cache``), holds bfloat16: half the
  memory per cached position. On a CPU the linear layers are ``cpu_linear.PackedLinear``
  (oneDNN's packed weights, at most 32 rows a call: a row's result is its solo result).
  On a CPU without native bf16 (AVX-512 BF16 or AMX) torch emulates it, slower.
* ``int8`` (CPU only): the linear layers' weights in int8 with a scale per output
  channel (``cpu_linear.Int8Linear``, torch's own quantizer and kernel), everything
  else as in bfloat16: a quarter of float32's weight bytes, the fastest at one stream,
  and the one whose greedy text departs most from float32's.

``default_precision`` is what ``auto`` (the app's default) means on a device.

A precision the device cannot run raises ``PrecisionError`` before anything is built;
the app names its setting in the message.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import cpu_linear
from .errors import PrecisionError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PRECISIONS = ("float32", "bfloat16", "int8")  # each batch-invariant (tests/test_engine_identity)


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX-BF16 in
    ``/proc/cpuinfo``'s flags; torch's capability string does not say)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_precision(device: torch.device) -> str:
    """What ``auto`` chooses: bfloat16 on a CPU that computes it natively (measured on
    one with AMX: the fastest from 8 streams up, 1.7x float32's tokens/s at 32, no slower
    at one; docs/results.md), float32 elsewhere (a GPU's bfloat16 is not measured here)."""
    if device.type == "cpu" and native_bf16_cpu() and cpu_linear.packing_available():
        return "bfloat16"
    return "float32"


def check(precision: str, device: torch.device) -> None:
    """Raise ``PrecisionError`` if ``device`` cannot run ``precision``."""
    if precision not in PRECISIONS:
        raise PrecisionError(
            f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if precision == "int8" and device.type != "cpu":
        raise PrecisionError(
            f"int8 runs on the CPU only (torch's int8 weight kernel), not {device}")
    if precision == "bfloat16" and device.type == "cuda" and not (
            torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        raise PrecisionError(f"bfloat16 needs a GPU that computes it; {device} does not")


def apply(model: PreTrainedModel, precision: str) -> PreTrainedModel:
    """``model`` (float32, on its device, in eval mode) in ``precision``; ``check`` first."""
    # The linear layers are made from the float32 weights (quantized or packed), then the
    # rest (embeddings, norms) is cast: no bfloat16 copy of the whole model in between.
    if precision == "int8":
        cpu_linear.swap_linears(model, cpu_linear.Int8Linear)
    elif precision == "bfloat16" and model.device.type == "cpu" and cpu_linear.packing_available():
        cpu_linear.swap_linears(model, cpu_linear.PackedLinear)
    if precision in ("bfloat16", "int8"):
        model = model.to(dtype=torch.bfloat16)  # type: ignore[call-arg]
        _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """Hand the float32 weights' freed pages back to the system: glibc keeps freed heap
    memory for reuse, and after the conversion that is about 100 MB of the embedded
    model's idle RSS that nothing reuses (``malloc_trim``; not glibc: nothing to do)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)

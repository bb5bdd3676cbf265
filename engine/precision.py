"""The weights' precision: float32 or bfloat16 (the product's), or int8 (the lab's).

One setting chooses it (``STREAMSCOPE_DTYPE`` in the app, ``precision`` here), among
``PRECISIONS``; the lab measures ``LAB_PRECISIONS`` (``python -m tools.lab precision``,
figures in docs/results.md):

* ``float32`` (the default): the weights as loaded (the embedded model's GGUF
  dequantized to float32). The only precision in which every concurrent answer of the
  embedded model equalled its solo run (32 of 32 greedy, 8 of 8 seeded).
* ``bfloat16``: every weight cast to bfloat16; the model computes in bfloat16 and the KV
  cache, which follows the model's dtype (``kv_cache``), holds bfloat16: half the
  memory per cached position. On a CPU without native bf16 (AVX-512 BF16 or AMX) torch
  emulates it, slower. Its logits are coarse (steps of 1/16-1/8 at the embedded model's
  magnitudes) and its matrix kernels round differently with the batch's size, so at a
  near-tie a concurrent answer can differ from the solo one: the identity tests pass on
  the tiny models (wide logits), the embedded model kept it in 20 of 32 greedy answers.
* ``int8``, in ``LAB_PRECISIONS`` only: torch's own dynamic quantization
  (``torch.ao.quantization.quantize_dynamic``) of every ``nn.Linear`` (GPT-2's ``Conv1D``
  layers are not ``nn.Linear``: there only the output layer): int8 weights, activations
  quantized on the fly, the result in float32; embeddings, norms and the KV cache stay
  float32. CPU only (fbgemm/x86/qnnpack kernels). Not offered, though the fastest: the
  activations' scale is ONE per input tensor, i.e. per batch, so every row's numbers
  depend on its batch mates (tests/test_engine_precision.py shows it; no concurrent
  answer of the embedded model equalled its solo run), and no greedy answer equalled
  float32's (the first token differed in 15 of 32).

A precision the device cannot run raises ``PrecisionError`` before anything is built;
the app names its setting in the message.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import PrecisionError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PRECISIONS = ("float32", "bfloat16")  # what the product offers: batch-invariant
LAB_PRECISIONS = (*PRECISIONS, "int8")  # what the lab measures
_QUANTIZED_ENGINES = ("x86", "fbgemm", "qnnpack")


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


def check(precision: str, device: torch.device) -> None:
    """Raise ``PrecisionError`` if ``device`` cannot run ``precision``."""
    if precision not in LAB_PRECISIONS:
        raise PrecisionError(
            f"unknown precision {precision!r}: one of {', '.join(LAB_PRECISIONS)}")
    if precision == "int8":
        if device.type != "cpu":
            raise PrecisionError(
                f"int8 runs on the CPU only (torch's dynamic quantization), not {device}")
        if not any(e in torch.backends.quantized.supported_engines for e in _QUANTIZED_ENGINES):
            raise PrecisionError("int8: this torch build has no quantized CPU engine")
    if precision == "bfloat16" and device.type == "cuda" and not (
            torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        raise PrecisionError(f"bfloat16 needs a GPU that computes it; {device} does not")


def apply(model: PreTrainedModel, precision: str) -> PreTrainedModel:
    """``model`` (float32, on its device, in eval mode) in ``precision``; ``check`` first."""
    if precision == "bfloat16":
        return model.to(dtype=torch.bfloat16)  # type: ignore[call-arg]
    if precision == "int8":
        engines = torch.backends.quantized.supported_engines
        if torch.backends.quantized.engine not in _QUANTIZED_ENGINES:
            torch.backends.quantized.engine = next(e for e in _QUANTIZED_ENGINES if e in engines)
        with warnings.catch_warnings():  # torch.ao is deprecated in favour of torchao (not here)
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            quantized: PreTrainedModel = torch.ao.quantization.quantize_dynamic(
                model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        return quantized
    return model

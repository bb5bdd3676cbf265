"""A Llama layer's projections that read the same input, joined into one kernel call.

Each of a Llama layer's query, key and value projections reads the same normed row, and
so do its MLP's gate and up projections: at one row each is a small call whose fixed cost
(the kernel's dispatch to its threads, the Python around it) is a good part of its time.
In ``int4`` they are joined at load (``Int4Linear.joined``): ``self_attn.qkv_proj`` and
``mlp.gate_up_proj``, which ``engine.llama_forward`` calls instead of the parts. A joined
layer gives the parts' outputs bit for bit (checked as it is made), so a pass that uses
it computes what the parts would; the parts stay, their packed weights views into the
joined one (no second copy), for whatever calls the library's own forward.

A joined layer has a shape of its own (960x576 and 3,072x576 on the embedded model), so
its rows per call are calibrated like every other shape's (``engine.batch_invariance``)
before it is attached: a row alone and among others keeps its bits in it too.
"""

from __future__ import annotations

import torch

from . import batch_invariance
from .int4_linear import Int4Linear

# (the module holding them, the parts' names, the joined layer's name)
JOINS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
)


def join_llama_projections(model: torch.nn.Module, precision: str) -> int:
    """Join each decoder layer's int4 projections of ``JOINS`` where the kernel allows
    (``Int4Linear.joined``); calibrate the joined layers, then attach them. Returns how
    many were attached. Raises ``PrecisionError`` (nothing attached) if the calibration
    finds a joined shape with no exact call size."""
    if type(model).__name__ != "LlamaForCausalLM":
        return 0
    made: list[tuple[torch.nn.Module, str, Int4Linear]] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        for holder_name, part_names, joined_name in JOINS:
            holder = getattr(layer, holder_name)
            parts = [getattr(holder, name) for name in part_names]
            if not all(type(part) is Int4Linear for part in parts):
                continue
            joined = Int4Linear.joined(parts)
            if joined is not None:
                made.append((holder, joined_name, joined))
    if made:
        batch_invariance.calibrate([joined for _, _, joined in made], precision)
    for holder, name, joined in made:
        setattr(holder, name, joined)
    return len(made)

"""The int8 layers compiled by inductor, beside torch's eager int8 kernel (issue 37).

``python -m tools.bench int8compile --precision int8`` (``--threads 2`` as the server's)
loads the embedded model twice in int8. The eager ``Int8Linear`` runs
``torch._weight_int8pack_mm``: the fastest step at one row (a quarter of float32's weight
bytes) but a loop of row products at 32 rows, slower than bfloat16 there. Inductor lowers the
same op to its CPU GEMM template, whose AMX micro-kernel widens the int8 weight to bfloat16
tiles as it goes; this measures whether that kernel gives one int8 precision both speeds.

In the second copy every linear layer's kernel is compiled on its own: ``torch.compile`` of a
module that holds only that layer's weight and scales, frozen as constants (the template
packs a constant weight), max-autotune over the CPP and ATen backends, the rows dimension
dynamic. Each module gets a code object of its own (dynamo keeps its cache per code object,
and 211 entries on one are searched on every call), and a lone row is padded to two (dynamo
would give a size of 1 a kernel of its own). Reported:

* ``compile_s``: compiling every layer (set ``TORCHINDUCTOR_CACHE_DIR`` to time a warm one);
* per batch size, one engine's decode steps alternated between the compiled and the eager
  copy (``overhead.side_by_side``: same cache, same sequences), each side's median;
* per layer shape, whether a row's output from the compiled kernel is the same alone (two
  rows) and in every batch up to ``--max-rows`` (the engine's identity needs it), and the
  same for the eager kernel.
"""

from __future__ import annotations

import argparse
import time
import types
from typing import Any

import torch
from torch._dynamo.utils import counters

from engine.attention import ATTENTION_NAME
from engine.cpu_linear import Int8Linear
from engine.model import load_model
from tools.bench.common import bench
from tools.bench.overhead import side_by_side, side_by_side_arguments
from tools.bench.step import engine_stepper, prompt_ids
from tools.lab.common import Report

INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


class _Kernel(torch.nn.Module):
    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, layer: Int8Linear) -> None:
        super().__init__()
        self.register_buffer("weight", layer.weight_int8)
        self.register_buffer("scales", layer.scales)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.weight, self.scales)


def compile_kernel(layer: Int8Linear, index: int) -> Any:
    """``layer``'s product, compiled now; a callable on rows (one row padded to two)."""
    code = _Kernel.forward.__code__.replace(co_name=f"int8_layer_{index}")
    forward = types.FunctionType(code, _Kernel.forward.__globals__)
    kernel = type(f"Int8Kernel{index}", (_Kernel,), {"forward": forward})(layer).eval()
    compiled = torch.compile(kernel, dynamic=True)
    with torch.inference_mode():  # the engine's rows are inference tensors: the same guards
        example = torch.zeros(4, layer.in_features, dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(example, 0)
        compiled(example)

    def rows(x: torch.Tensor) -> torch.Tensor:
        if len(x) == 1:
            return compiled(x.expand(2, -1).contiguous())[:1]
        return compiled(x)
    return rows


def rows_invariant(product: Any, in_features: int, max_rows: int) -> dict[str, Any]:
    """Whether row 0's output is the same in every batch of 1..max_rows rows."""
    x = torch.randn(max_rows, in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    with torch.inference_mode():
        solo = product(x[:1])[0]
        differing = [n for n in range(2, max_rows + 1) if not torch.equal(product(x[:n])[0], solo)]
    return {"invariant": not differing, "first_differing_rows": differing[0] if differing else None}


def arguments(parser: argparse.ArgumentParser) -> None:
    side_by_side_arguments(parser)
    parser.add_argument("--max-rows", type=int, default=64, help="of the invariance probe")


@bench("int8compile", "the int8 layers compiled by inductor (AMX) beside the eager int8 kernel",
       arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    if args.precision != "int8":
        raise SystemExit("int8compile compares int8 layers: pass --precision int8")
    loaded = load_model(args.model, args.device, precision="int8")
    engine_stepper(loaded, prompt_ids(loaded, 2, args.prompt_tokens), 4).step()  # one-off costs
    compiled_model = load_model(args.model, args.device, precision="int8").model
    compiled_model.set_attn_implementation(ATTENTION_NAME)  # as the engine did to the first
    torch._dynamo.config.recompile_limit = 1000  # one graph per layer; never a recompile
    layers = [m for m in compiled_model.modules() if isinstance(m, Int8Linear)]
    started = time.perf_counter()
    shapes: dict[tuple[int, int], dict[str, Any]] = {}
    # The whole run under inductor's settings: a recompile outside them would quietly run
    # the ATen kernel instead of the template's (``graphs`` counts them: one per layer).
    with torch._inductor.config.patch(INDUCTOR):
        for index, layer in enumerate(layers):
            layer._call = compile_kernel(layer, index)  # type: ignore[method-assign]
            shape = (layer.out_features, layer.in_features)
            if shape not in shapes:
                shapes[shape] = {"compiled": rows_invariant(layer._call, shape[1], args.max_rows),
                                 "eager": rows_invariant(types.MethodType(
                                     Int8Linear._call, layer), shape[1], args.max_rows)}
        compile_s = time.perf_counter() - started
        rows = [side_by_side(loaded, compiled_model, b, args) for b in args.batches]
    summary: dict[str, Any] = {
        "model": args.model, "threads": torch.get_num_threads(), "layers": len(layers),
        "compile_s": round(compile_s, 1),
        "graphs": counters["stats"]["unique_graphs"],
        "compiled_ms": {r["batch"]: r["compiled_ms"] for r in rows},
        "eager_ms": {r["batch"]: r["eager_ms"] for r in rows},
        "compiled_rows_invariant": all(s["compiled"]["invariant"] for s in shapes.values()),
        "eager_rows_invariant": all(s["eager"]["invariant"] for s in shapes.values()),
    }
    return Report(summary, {"steps": rows,
                            "shapes": {f"{o}x{i}": s for (o, i), s in shapes.items()}})

"""Time of prefilling a burst of prompts: one at a time against one batched pass.

``python -m tools.bench prefill`` loads the embedded model once,
admits the experiments' 32 prompts into an engine, and times, in rounds that
alternate the variants so that all of them see the same load on a shared
machine:

* ``serial``: one forward pass per prompt (the engine before issue 10);
* ``packed``: the engine's prefill, every prompt in ONE forward pass packed into
  one row, causal attention run per prompt (in bfloat16 and int8, per prompt and
  padded length: ``attention._rows_alone``);
* ``masked``: the same packed row, attention in one call with a block-diagonal
  causal mask (what a varlen kernel would do);
* ``padded``: the prompts right-padded into a (prompts, longest) batch, causal
  attention per row, the padded keys never written to the cache;
* ``causal``: the packed row with one causal call per prompt (the engine before each
  row got a call per padded length, ``attention._packed_causal``: a chunk's call blocks
  the keys by the chunk's length, so a row's result depended on where its prompt was cut).

``--prompt-repeat K`` makes each prompt K copies of itself (a long prompt: ``--prompts 1
--prompt-repeat 30`` is about 1,200 tokens of the embedded model).

For each variant it reports the median (and least) time over the rounds, the
ratio to serial, and whether each prompt's last-position logits equal serial's
bit for bit, the largest difference, and whether every argmax agrees. On CPU,
``packed`` gives each prompt the hidden states of its serial pass bit for bit;
its logits still differ in the last bits (about 1e-5 on the embedded model)
because serial projects one row at a time to the vocabulary, and MKL computes a
one- or two-row product by another path than a many-row one: the same reason a
batched decode's logits differ from a solo decode's. The variants other than
``packed`` plug in their own attention functions here; the engine has only
``packed`` (a runner wrapped in ``tools.serial_prefill.SerialPrefill`` gives ``serial``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine import GenerationRequest, SamplingParams
from engine.engine import Engine
from engine.model import load_model
from engine.model_runner import ModelRunner
from engine.paged_batch import PagedBatch, prefill_batch
from engine.sequence import Sequence
from tools.bench.common import bench
from tools.lab.common import Report
from tools.prompts import load_prompts

MASKED, PADDED, CAUSAL = "prefillbench_masked", "prefillbench_padded", "prefillbench_causal"


def masked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedBatch | None = None,
    mask: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The packed row's keys written as the engine does, then ONE masked attention."""
    assert paged is not None and mask is not None
    _write(module, key, value, paged)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def padded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedBatch | None = None,
    real: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Only the real positions' keys written; causal attention per padded row."""
    assert paged is not None and real is not None
    pick = (key.transpose(1, 2)[real], value.transpose(1, 2)[real])  # (tokens, kv, dim)
    layer: int = module.layer_idx  # type: ignore[assignment]
    paged.cache.keys[layer].index_copy_(0, paged.write_slots, pick[0])
    paged.cache.values[layer].index_copy_(0, paged.write_slots, pick[1])
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _write(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, p: PagedBatch) -> None:
    layer: int = module.layer_idx  # type: ignore[assignment]
    kv_heads, dim = key.shape[1], key.shape[3]
    for cache, new in ((p.cache.keys[layer], key), (p.cache.values[layer], value)):
        cache.index_copy_(0, p.write_slots, new.transpose(1, 2).reshape(-1, kv_heads, dim))


def causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Whole prompts packed in one row, one causal call per prompt (no cached prefix)."""
    assert paged is not None
    _write(module, key, value, paged)
    parts, start = [], 0
    for n in paged.prompt_lengths:
        q, k, v = (x[:, :, start : start + n].contiguous() for x in (query, key, value))
        parts.append(F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]))
        start += n
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(MASKED, masked_attention)
AttentionInterface.register(CAUSAL, causal_attention)
AttentionInterface.register(PADDED, padded_attention)
Prefill = Callable[[ModelRunner, list[Sequence]], torch.Tensor]  # last-position logits


@torch.inference_mode()
def serial(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    return torch.cat([_packed_logits(runner, [s]) for s in seqs])


@torch.inference_mode()
def packed(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    return _packed_logits(runner, seqs)


def _packed_logits(runner: ModelRunner, seqs: list[Sequence], **extra: object) -> torch.Tensor:
    lengths = [s.num_prompt_tokens for s in seqs]
    batch, positions = prefill_batch(runner.cache, runner._tables(seqs), lengths,
                                     rows_alone=runner.rows_alone)
    input_ids = torch.tensor([[t for s in seqs for t in s.prompt_ids]])
    last = torch.cumsum(torch.tensor(lengths), 0) - 1
    out = runner.model(
        input_ids=input_ids, position_ids=positions, paged=batch, use_cache=False,
        logits_to_keep=last, **extra,
    )
    return out.logits[0]


@torch.inference_mode()
def masked(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    lengths = [s.num_prompt_tokens for s in seqs]
    blocks = [torch.ones(n, n, dtype=torch.bool).tril() for n in lengths]
    runner.model.set_attn_implementation(MASKED)
    try:
        return _packed_logits(runner, seqs, mask=torch.block_diag(*blocks))
    finally:
        runner.model.set_attn_implementation("streamscope_paged")


@torch.inference_mode()
def causal(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    runner.model.set_attn_implementation(CAUSAL)
    try:
        return _packed_logits(runner, seqs)
    finally:
        runner.model.set_attn_implementation("streamscope_paged")


@torch.inference_mode()
def padded(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    lengths = torch.tensor([s.num_prompt_tokens for s in seqs])
    width = int(lengths.max())
    positions = torch.arange(width).expand(len(seqs), -1)
    real = positions < lengths[:, None]
    input_ids = torch.tensor([s.prompt_ids + [0] * (width - len(s.prompt_ids)) for s in seqs])
    slots = runner.cache.slots(runner._tables(seqs), positions)[real]
    batch = PagedBatch(runner.cache, slots)
    runner.model.set_attn_implementation(PADDED)
    try:
        hidden = runner.model.model(
            input_ids=input_ids, position_ids=positions, paged=batch, use_cache=False, real=real
        ).last_hidden_state
    finally:
        runner.model.set_attn_implementation("streamscope_paged")
    return runner.model.lm_head(hidden[torch.arange(len(seqs)), lengths - 1])


VARIANTS: dict[str, Prefill] = {
    "serial": serial, "packed": packed, "masked": masked, "padded": padded, "causal": causal,
}


def admitted(model: str, count: int, precision: str = "float32", repeat: int = 1,
             ) -> tuple[ModelRunner, list[Sequence]]:
    """An engine's runner and ``count`` admitted prompts (block tables, no prefill yet)."""
    engine = Engine(
        load_model(model, "cpu", precision=precision), max_batch=count,
        num_blocks=count * 32 * repeat, block_size=16,
        max_prefill_tokens=1_000_000,  # every prompt in the one plan
    )
    prompts = load_prompts()
    for i in range(count):
        params = SamplingParams(ignore_eos=True)
        prompt = " ".join([prompts[i % len(prompts)]] * repeat)
        engine.submit(GenerationRequest(f"p{i}", prompt, 8, sampling=params))
    engine.scheduler.apply_inbox()
    seqs = [chunk.seq for chunk in engine.scheduler.schedule().prefill]
    assert isinstance(engine.runner, ModelRunner) and len(seqs) == count
    return engine.runner, seqs


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of every variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--prompt-repeat", type=int, default=1,
                        help="each prompt this many copies of itself (long prompts)")


@bench("prefill", "a burst's prefill: one pass per prompt against packed, masked, padded",
       arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    runner, seqs = admitted(args.model, args.prompts, args.precision, args.prompt_repeat)
    times: dict[str, list[float]] = {name: [] for name in args.variants}
    logits: dict[str, torch.Tensor] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up, untimed
        for name in args.variants:
            started = time.perf_counter()
            logits[name] = VARIANTS[name](runner, seqs)
            if round_:
                times[name].append((time.perf_counter() - started) * 1000)
    reference = logits.get("serial", logits[args.variants[0]])
    rows = []
    base = statistics.median(times[args.variants[0]])
    for name in args.variants:
        diff = float((logits[name] - reference).abs().max())
        ms = statistics.median(times[name])
        rows.append({
            "variant": name, "median_ms": round(ms, 1), "ratio": round(ms / base, 3),
            "min_ms": round(min(times[name]), 1),
            "bit_identical": bool(torch.equal(logits[name], reference)),
            "max_abs_diff": diff,
            "same_argmax": bool(torch.equal(logits[name].argmax(-1), reference.argmax(-1))),
            "runs_ms": [round(t, 1) for t in times[name]],
        })
    summary = {"model": args.model, "prompts": args.prompts,
               "prompt_tokens": sum(s.num_prompt_tokens for s in seqs),
               "rounds": args.rounds, "threads": torch.get_num_threads(),
               "median_ms": {r["variant"]: r["median_ms"] for r in rows},
               "ratio_to_first": {r["variant"]: r["ratio"] for r in rows},
               "same_argmax": all(r["same_argmax"] for r in rows)}
    return Report(summary, {"rows": rows})

"""Prefix caching on and off, in one run: multi-turn chats with a common system prompt.

``python -m tools.bench prefixcache`` loads the model once and runs the
same workload on two fresh engines over it, ``prefix_cache`` off then on, in-process
(no HTTP: what is measured is the engine). Each of ``--conversations`` chats has
``--turns`` turns; every turn re-sends its chat's whole history (a ``--system``-token
system prompt shared by all, then each turn's user tokens and the answer that engine
gave), every chat's turn submitted at once. Per turn and mode: TTFT (median and max,
from the submit to the first token event), the prompt positions actually prefilled
(queries less hits), tokens/s; then the share of answers identical between the modes.
``--burst N`` adds N simultaneous requests sharing one ``--burst-system``-token system
prompt (TTFT p50/p99). Greedy, ``ignore_eos``: every answer is ``--answer`` tokens.
Wrap it in ``flock /tmp/streamscope-bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from engine import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from tools.bench.common import bench
from tools.lab.common import Report
from tools.prompts import load_prompts

GREEDY = SamplingParams(ignore_eos=True)


def _text_tokens(loaded: LoadedModel, count: int, offset: int = 0) -> list[int]:
    """``count`` token ids of the experiments' English prompts, from prompt ``offset``."""
    prompts = load_prompts()
    ids: list[int] = []
    index = offset
    while len(ids) < count:
        ids += loaded.tokenizer.encode(" " + prompts[index % len(prompts)],
                                       add_special_tokens=False)
        index += 1
    return ids[:count]


def _run_batch(engine: Engine, prompts: dict[str, list[int]], answer: int,
               namespace: bytes = b"") -> tuple[dict[str, float], dict[str, list[int]], float]:
    """Submit every prompt at once, step until done: TTFT ms and ids per request, and
    the wall time in s."""
    started = time.perf_counter()
    for rid, ids in prompts.items():
        engine.submit(GenerationRequest(rid, "", answer, sampling=GREEDY,
                                        prompt_token_ids=tuple(ids), cache_namespace=namespace))
    ttft: dict[str, float] = {}
    ids_of: dict[str, list[int]] = {rid: [] for rid in prompts}
    done = 0
    while done < len(prompts):
        for event in engine.step():
            if isinstance(event, TokenEvent):
                ttft.setdefault(event.request_id, (time.perf_counter() - started) * 1000)
                ids_of[event.request_id].append(event.token_id)
            elif isinstance(event, FinishEvent):
                done += 1
    return ttft, ids_of, time.perf_counter() - started


def _prefilled(engine: Engine) -> int:
    stats = engine.statistics()
    return stats.prefix_cache_queries - stats.prefix_cache_hits


def chats(loaded: LoadedModel, on: bool, args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(loaded, max_batch=max(args.conversations, args.burst, 1),
                    num_blocks=args.blocks, block_size=16, prefix_cache=on)
    system = _text_tokens(loaded, args.system)
    history = {f"c{c}": list(system) for c in range(args.conversations)}
    turns: list[dict[str, Any]] = []
    answers: list[dict[str, list[int]]] = []
    for turn in range(args.turns):
        for c, rid in enumerate(history):
            history[rid] += _text_tokens(loaded, args.user, offset=3 + c * 7 + turn)
        prompt_tokens = sum(len(h) for h in history.values())
        before = engine.statistics()
        computed_before = before.prefix_cache_queries - before.prefix_cache_hits
        ttft, ids, wall = _run_batch(engine, {f"{r}t{turn}": h for r, h in history.items()},
                                     args.answer, bytes.fromhex(args.cache_namespace))
        stats = engine.statistics()
        computed = (stats.prefix_cache_queries - stats.prefix_cache_hits - computed_before
                    if on else prompt_tokens)
        for rid in history:
            history[rid] += ids[f"{rid}t{turn}"]
        answers.append({rid: ids[f"{rid}t{turn}"] for rid in history})
        turns.append({
            "turn": turn + 1, "prompt_tokens": prompt_tokens, "prefilled_tokens": computed,
            "ttft_ms_median": round(statistics.median(ttft.values()), 1),
            "ttft_ms_max": round(max(ttft.values()), 1),
            "tokens_per_s": round(args.conversations * args.answer / wall, 1),
        })
    stats = engine.statistics()
    return {"turns": turns, "answers": answers, "blocks_cached": stats.blocks_cached,
            "blocks_evicted": stats.blocks_evicted}


def burst(loaded: LoadedModel, on: bool, args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(loaded, max_batch=args.burst, num_blocks=args.blocks, block_size=16,
                    prefix_cache=on)
    system = _text_tokens(loaded, args.burst_system)
    prompts = {f"b{i}": system + _text_tokens(loaded, args.user, offset=i)
               for i in range(args.burst)}
    ttft, _, wall = _run_batch(engine, prompts, args.answer, bytes.fromhex(args.cache_namespace))
    ordered = sorted(ttft.values())
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"ttft_ms_p50": round(statistics.median(ordered), 1), "ttft_ms_p99": round(p99, 1),
            "wall_s": round(wall, 2), "prefilled_tokens": _prefilled(engine) if on else
            sum(len(p) for p in prompts.values())}


def draw(result: dict[str, Any], fig: Any) -> None:
    """TTFT per turn (median, cache off and on) and the prompt positions prefilled."""
    ttft, filled = fig.subplots(1, 2)
    for mode, run in result["chats"].items():
        turns = [t["turn"] for t in run["turns"]]
        ttft.plot(turns, [t["ttft_ms_median"] for t in run["turns"]], marker="o",
                  label=f"cache {mode}")
        filled.plot(turns, [t["prefilled_tokens"] for t in run["turns"]], marker="o",
                    label=f"cache {mode}")
    ttft.set(xlabel="turn", ylabel="TTFT median (ms)", title="time to first token")
    filled.set(xlabel="turn", ylabel="positions prefilled", title="prompt prefilled")
    for axes in (ttft, filled):
        axes.legend()
        axes.grid(alpha=0.3)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=500, help="system prompt tokens")
    parser.add_argument("--user", type=int, default=30, help="user tokens a turn")
    parser.add_argument("--answer", type=int, default=16, help="tokens an answer")
    parser.add_argument("--burst", type=int, default=0)
    parser.add_argument("--burst-system", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--cache-namespace", default="", help="every request's, in hex "
                        "(one API key's, as the app derives it); empty: the plain root")


@bench("prefixcache", "prefix caching off and on: chats re-sending their history, a burst "
       "with one system prompt", arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    loaded = load_model(args.model, "cpu")
    runs = {mode: chats(loaded, mode == "on", args) for mode in ("off", "on")}
    answers = [(a, b) for t_off, t_on in zip(runs["off"]["answers"], runs["on"]["answers"],
                                             strict=True)
               for a, b in zip(t_off.values(), t_on.values(), strict=True)]
    result: dict[str, Any] = {"chats": {mode: {k: v for k, v in run.items() if k != "answers"}
                                        for mode, run in runs.items()}}
    # Where a pair differs: the turn, the chat and the first token that differs (a later
    # turn's prompt carries its chat's earlier answers, so one difference propagates).
    result["differences"] = [
        {"turn": t + 1, "chat": rid, "first_token": next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))}
        for t, (t_off, t_on) in enumerate(zip(runs["off"]["answers"], runs["on"]["answers"],
                                              strict=True))
        for rid, a, b in zip(t_off, t_off.values(), t_on.values(), strict=True) if a != b]
    last_off, last_on = runs["off"]["turns"][-1], runs["on"]["turns"][-1]
    summary: dict[str, Any] = {
        "identical_answers": sum(a == b for a, b in answers) / max(len(answers), 1),
        "last_turn_ttft_ratio": round(last_on["ttft_ms_median"] / last_off["ttft_ms_median"], 3),
        "prefilled_share": round(
            sum(t["prefilled_tokens"] for t in runs["on"]["turns"])
            / sum(t["prefilled_tokens"] for t in runs["off"]["turns"]), 3),
    }
    if args.burst:
        result["burst"] = {mode: burst(loaded, mode == "on", args) for mode in ("off", "on")}
        summary["burst"] = result["burst"]
    return Report(summary, result, plot=lambda fig: draw(result, fig))

"""``capacity``: how many streams the KV cache lets run, blocks on demand against reservation.

Issue 14. Clients send chat requests (``/v1/chat/completions``, through the model's chat
template, greedy) with a large ``max_tokens`` (1024, as OpenAI clients often do) and short
questions whose answers end by themselves. With the reservation scheme every request
holds prompt + ``max_tokens`` positions from admission, so few run at once although each
uses a fraction of that; with blocks on demand a request holds what it wrote.

Procedure. Three servers with the same model, one after another, each receiving
``--clients`` requests (default 64; quick 16) at once:

* ``on_demand`` and ``reserve``: the same cache (``--blocks``, default 512 blocks of 16
  positions, the issue's setting; quick 16), the service's admission (blocks on demand)
  or the lab's reservation (``STREAMSCOPE_LAB_KV_ADMISSION=reserve``: ``reservation.py``);
* ``small``: on demand with a cache far too small for the batch (``--small-blocks``,
  default 64; quick 6; ``max_tokens`` capped at ``--small-max-tokens``, default 256, quick
  48, so that one request fits the cache), so that running sequences are preempted and
  recomputed. Before the burst, the first ``--solo`` (default 8) requests run alone, one
  at a time, on the same server: the burst's answers to them must be identical, whole
  answers with the same text and token count (``identical_small``).

``/stats`` is sampled every 0.25 s. Summary per condition: ``running_max``, ``running_mean``
(over samples while anything ran or waited), ``tokens_per_s`` (completion tokens of all
streams over the burst's makespan), ``ttft_p50``/``ttft_p99`` (ms, from the send to the
first content chunk), ``makespan_s``, ``completion_tokens_max``, ``finish_reasons``,
``preemptions``, ``recomputed_tokens``; and ``identical_small`` / ``solo_compared``. Plot:
running sequences over time for the three conditions.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import trio

from tools.lab.common import Lab, Report, experiment, pct

SAMPLE_S = 0.25
# Questions whose answers are short and end by themselves (a greedy instruct model says
# its piece and stops): the point is that a request asks for far more than it uses.
QUESTIONS = (
    "What is the capital of France?", "How many legs does a spider have?",
    "Name the largest planet in the solar system.", "What colour is the sky on a clear day?",
    "What is 12 times 12?", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "Name a mammal that can fly.",
    "What language is spoken in Brazil?", "How many days are in a leap year?",
    "What is the chemical symbol for gold?", "Which ocean is the largest?",
    "What is the opposite of hot?", "How many continents are there?",
    "What do bees make?", "What is the freezing point of water in Fahrenheit?",
)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, help="default 64 (quick 16)")
    parser.add_argument("--max-tokens", type=int, help="default 1024 (quick 48)")
    parser.add_argument("--blocks", type=int, help="cache blocks, default 512 (quick 16)")
    parser.add_argument("--small-blocks", type=int, help="default 64 (quick 6)")
    parser.add_argument("--small-max-tokens", type=int,
                        help="max_tokens in the small cache, default 256 (quick 48): a request "
                             "whose prompt plus max_tokens exceeds the whole cache is refused")
    parser.add_argument("--solo", type=int, help="requests run alone first, default 8 (quick 4)")
    parser.add_argument("--conditions", default="on_demand,reserve,small",
                        help="which conditions to run, comma-separated (a long run in parts)")


@experiment(
    "capacity",
    "chat requests with a large max_tokens: concurrency, tokens/s and TTFT with KV blocks "
    "on demand against reservation at the same memory, and preemption in a small cache",
    server={"max_batch": 32, "max_waiting": 512},
    arguments=arguments,
    own_servers=True,
)
async def capacity(lab: Lab) -> Report:
    clients = lab.option("clients", 64, 16)
    max_tokens = lab.option("max_tokens", 1024, 48)
    blocks = lab.option("blocks", 512, 16)
    small_blocks = lab.option("small_blocks", 64, 6)
    small_max_tokens = min(max_tokens, lab.option("small_max_tokens", 256, 48))
    solo_count = lab.option("solo", 8, 4)
    # The tiny random models have no chat template: their prompts go to /v1/completions.
    chat = str(lab.server_settings.get("model") or "smollm2") not in ("tiny-gpt2", "tiny-llama")
    bodies = [_body(QUESTIONS[i % len(QUESTIONS)], max_tokens, chat) for i in range(clients)]
    small_bodies = [{**body, "max_tokens": small_max_tokens} for body in bodies]
    conditions = {"on_demand": (blocks, "on_demand"), "reserve": (blocks, "reserve"),
                  "small": (small_blocks, "on_demand")}
    chosen = str(getattr(lab.args, "conditions", None) or ",".join(conditions)).split(",")
    conditions = {k: v for k, v in conditions.items() if k in chosen}
    summary: dict[str, Any] = {"clients": clients, "max_tokens": max_tokens,
                               "blocks": blocks, "small_blocks": small_blocks,
                               "small_max_tokens": small_max_tokens}
    raw: dict[str, Any] = {}
    for name, (num_blocks, scheme) in conditions.items():
        async with lab.server(cache_blocks=num_blocks, lab_kv_admission=scheme) as url:
            solo = []
            burst = small_bodies if name == "small" else bodies
            if name == "small":
                for body in burst[:solo_count]:
                    solo.append(await _chat(url, body, time.perf_counter()))
            before = await lab.stats(url)
            run = await _burst(lab, url, burst)
            after = await lab.wait_idle(url)
        records = run["records"]
        figures = _figures(records, run["samples"], run["makespan_s"])
        figures["preemptions"] = after["preemptions"] - before["preemptions"]
        figures["recomputed_tokens"] = after["recomputed_tokens"] - before["recomputed_tokens"]
        figures["blocks_leaked"] = after["blocks_total"] - after["blocks_free"]
        for key, value in figures.items():
            summary[f"{key}_{name}"] = value
        if solo:
            # Only answers that came whole count: two failures with empty texts are not "the same".
            same = [_whole(s) and _whole(r) and s["text"] == r["text"]
                    and s["completion_tokens"] == r["completion_tokens"]
                    for s, r in zip(solo, records, strict=False)]
            summary["identical_small"] = sum(same)
            summary["solo_compared"] = len(same)
        raw[name] = {"records": records, "samples": run["samples"], "solo": solo,
                     "stats_after": after}
    return Report(summary, raw, plot=lambda fig: _draw(fig, raw))


def _whole(record: dict[str, Any]) -> bool:
    """Whether a streamed answer arrived whole: 200, a finish reason and its usage."""
    return (record["status"] == 200 and record["finish_reason"] is not None
            and bool(record["completion_tokens"]))


def _body(question: str, max_tokens: int, chat: bool) -> dict[str, Any]:
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": question}]} if chat else {"prompt": question})
    return {**prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


async def _burst(lab: Lab, url: str, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """Every body at once; /stats sampled meanwhile."""
    records: list[dict[str, Any]] = [{} for _ in bodies]
    samples: list[dict[str, Any]] = []
    started = time.perf_counter()

    async def one(i: int) -> None:
        records[i] = await _chat(url, bodies[i], started)

    async with trio.open_nursery() as monitor:
        monitor.start_soon(_sample, lab, url, samples, started)
        async with trio.open_nursery() as nursery:
            for i in range(len(bodies)):
                nursery.start_soon(one, i)
        makespan = time.perf_counter() - started
        monitor.cancel_scope.cancel(reason="every client is done")
    return {"records": records, "samples": samples, "makespan_s": makespan}


async def _chat(url: str, body: dict[str, Any], started: float) -> dict[str, Any]:
    """One streamed chat completion: its text, first-chunk time and usage."""
    import httpx

    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    reason: str | None = None
    async with (
        httpx.AsyncClient(base_url=url, timeout=600.0, trust_env=False) as client,
        client.stream("POST", "/v1/chat/completions" if "messages" in body
                      else "/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("text") or choice.get("delta", {}).get("content")
                if content and first is None:
                    first = time.perf_counter()
                text.append(content or "")
                reason = choice.get("finish_reason") or reason
    end = time.perf_counter()
    return {"status": response.status_code, "sent_s": round(sent - started, 3),
            "ttft_ms": None if first is None else round((first - sent) * 1000, 1),
            "end_s": round(end - started, 3), "text": "".join(text), "finish_reason": reason,
            "completion_tokens": (usage or {}).get("completion_tokens")}


async def _sample(lab: Lab, url: str, samples: list[dict[str, Any]], started: float) -> None:
    async with lab.client(url) as client:
        while True:
            stats = await lab.stats(client=client)
            samples.append({"t_s": round(time.perf_counter() - started, 3),
                            **{k: stats.get(k) for k in ("running", "waiting", "blocks_free",
                                                         "blocks_filled", "preemptions")}})
            await trio.sleep(SAMPLE_S)


def _figures(records: list[dict[str, Any]], samples: list[dict[str, Any]],
             makespan_s: float) -> dict[str, Any]:
    busy = [s["running"] for s in samples if (s["running"] or 0) + (s["waiting"] or 0)]
    ttfts = [r["ttft_ms"] for r in records if r.get("ttft_ms") is not None]
    tokens = [r["completion_tokens"] or 0 for r in records]
    reasons: dict[str, int] = {}
    for r in records:
        reasons[str(r.get("finish_reason"))] = reasons.get(str(r.get("finish_reason")), 0) + 1
    return {
        "running_max": max(busy, default=0),
        "running_mean": round(sum(busy) / len(busy), 1) if busy else 0,
        "tokens_per_s": round(sum(tokens) / makespan_s, 1),
        "ttft_p50": _round(pct(ttfts, 50)),
        "ttft_p99": _round(pct(ttfts, 99)),
        "makespan_s": round(makespan_s, 2),
        "completion_tokens_max": max(tokens, default=0),
        "completion_tokens_mean": round(sum(tokens) / len(tokens), 1) if tokens else 0,
        "finish_reasons": reasons,
        "errors": sum(r.get("status") != 200 for r in records),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _draw(fig: Any, raw: dict[str, Any]) -> None:
    ax = fig.subplots(1, 1)
    for name, run in raw.items():
        samples = run["samples"]
        ax.plot([s["t_s"] for s in samples], [s["running"] for s in samples], label=name)
    ax.set_xlabel("time since the burst (s)")
    ax.set_ylabel("sequences running")
    ax.set_title("running sequences: KV blocks on demand, reserved, and a small cache")
    ax.legend()
    ax.grid(alpha=0.3)

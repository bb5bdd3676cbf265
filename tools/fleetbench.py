"""Many conversations over three replicas: least connections against conversation affinity.

``python -m tools.fleetbench [--replicas 3] [--conversations 12] [--turns 4]
[--concurrency 6] [--rules 12] [--interleave] [--cache-blocks N] [--json FILE]`` starts a Redis,
``--replicas`` ``streamscope serve`` processes (the embedded model unless ``--model``) and
HAProxy (``tools.cluster``), three times: with a copy of ``deploy/haproxy.cfg`` whose
affinity rules are cut out (every request by least connections, the config as it was
before conversation affinity); with the config as shipped; and with the config as shipped
and a replica killed. Each time it runs the same conversations through the official openai
SDK, half chat completions carrying ``prompt_cache_key``, half Responses chained by
``previous_response_id``, ``--concurrency`` at once, every request on a new connection (a
shared pool without keep-alive, as many clients behind a NAT or a serverless function are:
nothing but the key can keep a conversation in place).

Each conversation opens with long instructions of its own (about 500 tokens, more with
``--rules``: an agent's system prompt), sent again at every turn. Each turn is streamed: its
TTFT (request to first text), its prompt and cached prompt tokens (the usage the server
reports), and the replica that answered (``Streamscope-Replica``). In the third run, after
half the turns, the replica that served most is killed (SIGKILL) between turns: its
conversations' later turns must each land on one other replica, miss the cache once there,
and hit it again from the turn after.

Writes, per configuration: cached / prompt tokens over turns 2 and later, TTFT p50 and
p99 per turn number and over turns 2 and later, each replica's share of requests and
its ratio to the mean, failed requests; and the affinity over least-connections ratios.
Run it on an otherwise quiet machine: TTFT figures are ratios of one run. A replica's
cache sized by memory holds a few dozen such conversations; ``--cache-blocks`` (16
positions a block) sizes it to hold only some of them, the case of a real fleet, whose
conversations outnumber what one replica's cache holds: by least connections every
replica must hold every conversation, with affinity each holds its share.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from tools.cluster import HAPROXY_CFG, Cluster, open_cluster
from tools.records import percentile

QUESTIONS = ["What is the capital of France?", "Name three rivers in Europe.",
             "How do bees make honey?", "Why is the sky blue?", "What is a prime number?",
             "Who wrote Hamlet?", "What do plants need to grow?", "How far is the Moon?"]
FOLLOW_UP = "Tell me more, in one sentence."
# Each conversation opens with its own long instructions (an agent's system prompt, its
# tools' descriptions): what a replica without the conversation's cache must prefill
# again at every turn. Its number comes first, so no two conversations share a block.
# Twelve rules make about 500 tokens; ``--rules`` lengthens them (about 40 tokens a rule),
# for a history whose prefill outweighs the CPU the replicas share.
DEFAULT_RULES = 12


def system_prompt(n: int, rules: int) -> str:
    return (f"You are assistant number {n} of a help desk. Answer briefly and politely. "
            + " ".join(f"Rule {i}: when a question is about topic {i}, say what you know of "
                       "it in plain words, name one source a reader could check, and never "
                       "invent a figure you were not given." for i in range(1, rules + 1)))
REPLICA_HEADER = "streamscope-replica"


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: int
    api: str  # "chat" or "responses"
    turn: int  # 1-based
    ok: bool
    replica: str | None
    ttft_ms: float | None
    prompt_tokens: int
    cached_tokens: int
    after_kill: bool


def least_connections_cfg(directory: Path) -> Path:
    """deploy/haproxy.cfg without its affinity rules: every request by least connections."""
    text = HAPROXY_CFG.read_text()
    cut = re.sub(r"^\s*(use_backend by_conversation|stick match).*\n", "", text, flags=re.M)
    assert cut != text, "deploy/haproxy.cfg has no affinity rules to cut"
    path = directory / "haproxy-leastconn.cfg"
    path.write_text(cut)
    return path


def client_of(url: str) -> openai.OpenAI:
    """The SDK on a pool that keeps no connection: each request is a connection of its own."""
    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), trust_env=False,
                        timeout=300.0)
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", http_client=http,
                         max_retries=0)


def chat_turn(client: openai.OpenAI, model: str, key: str,
              messages: list[dict[str, str]], answer: int) -> tuple[str | None, float, str, Any]:
    started = time.perf_counter()
    first, text, usage = None, "", None
    create: Any = client.chat.completions.with_streaming_response.create  # plain dicts
    with create(
            model=model, messages=messages, max_tokens=answer, temperature=0, stream=True,
            stream_options={"include_usage": True}, prompt_cache_key=key) as raw:
        replica = raw.headers.get(REPLICA_HEADER)
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
    assert usage is not None and first is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return replica, (first - started) * 1000, text, (usage.prompt_tokens, cached or 0)


def responses_turn(client: openai.OpenAI, model: str, previous: str | None, system: str,
                   question: str, answer: int) -> tuple[str | None, float, str, Any]:
    started = time.perf_counter()
    first, response_id, usage = None, "", None
    extra = {"previous_response_id": previous} if previous else {}
    create: Any = client.responses.with_streaming_response.create  # **extra
    with create(
            model=model, instructions=system, input=question, max_output_tokens=answer,
            temperature=0,
            stream=True, **extra) as raw:
        replica = raw.headers.get(REPLICA_HEADER)
        for event in raw.parse():
            if event.type == "response.output_text.delta":
                first = first or time.perf_counter()
            if event.type in ("response.completed", "response.incomplete"):
                response_id, usage = event.response.id, event.response.usage
    assert usage is not None and first is not None
    details = usage.input_tokens_details
    return replica, (first - started) * 1000, response_id, (
        usage.input_tokens, details.cached_tokens if details else 0)


class Conversation:
    """One conversation's state between turns; ``take`` runs its next turns in order (a
    thread's work). A failed turn ends it."""

    def __init__(self, url: str, model: str, index: int, answer: int, rules: int) -> None:
        self.client, self.model, self.index, self.answer = client_of(url), model, index, answer
        self.api = "chat" if index % 2 == 0 else "responses"
        self.system = system_prompt(index, rules)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}]
        self.previous: str | None = None
        self.turns: list[Turn] = []
        self.failed = False

    def take(self, first: int, last: int, after_kill: bool) -> None:
        for turn in range(first, last + 1):
            if self.failed:
                return
            question = (f"{QUESTIONS[self.index % len(QUESTIONS)]} ({self.index})"
                        if turn == 1 else FOLLOW_UP)
            try:
                if self.api == "chat":
                    self.messages.append({"role": "user", "content": question})
                    replica, ttft, text, (prompt, cached) = chat_turn(
                        self.client, self.model, f"conversation-{self.index}", self.messages,
                        self.answer)
                    self.messages.append({"role": "assistant", "content": text})
                else:
                    replica, ttft, self.previous, (prompt, cached) = responses_turn(
                        self.client, self.model, self.previous, self.system, question,
                        self.answer)
            except (openai.APIError, httpx.HTTPError, AssertionError):
                self.failed = True
                self.turns.append(Turn(self.index, self.api, turn, False, None, None, 0, 0,
                                       after_kill))
                return
            self.turns.append(Turn(self.index, self.api, turn, True, replica, ttft, prompt,
                                   cached, after_kill))


async def take_turns(conversations: list[Conversation], first: int, last: int,
                     concurrency: int, after_kill: bool, interleave: bool = False) -> None:
    """Turns ``first`` to ``last`` of every conversation, ``concurrency`` conversations
    at once, in worker threads (the SDK's client is synchronous). By default a
    conversation takes its turns back to back; with ``interleave``, turn k of every
    conversation comes before turn k + 1 of any (users who read and think between turns,
    whose requests arrive between one another's: what a fleet sees)."""
    def run(turns: list[tuple[int, int]]) -> None:
        with ThreadPoolExecutor(concurrency) as pool:
            for low, high in turns:
                futures = [pool.submit(c.take, low, high, after_kill) for c in conversations]
                for future in futures:
                    future.result()

    rounds = [(t, t) for t in range(first, last + 1)] if interleave else [(first, last)]
    await trio.to_thread.run_sync(run, rounds)


def summary(turns: list[Turn], replicas: int) -> dict[str, Any]:
    later = [t for t in turns if t.ok and t.turn >= 2]
    shares = Counter(t.replica for t in turns if t.ok)
    mean = sum(shares.values()) / replicas

    def ttft(selected: list[Turn]) -> dict[str, float | None]:
        values = [t.ttft_ms for t in selected if t.ttft_ms is not None]
        return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}

    return {
        "cached_over_prompt_turn2plus": (sum(t.cached_tokens for t in later)
                                         / max(1, sum(t.prompt_tokens for t in later))),
        "ttft_ms_turn2plus": ttft(later),
        "ttft_ms_by_turn": {n: ttft([t for t in turns if t.ok and t.turn == n])
                            for n in sorted({t.turn for t in turns})},
        "replica_shares": dict(sorted(shares.items(), key=lambda kv: str(kv[0]))),
        "max_share_over_mean": max(shares.values()) / mean if shares else None,
        "failed": sum(not t.ok for t in turns),
    }


async def run_once(cfg: Path, args: argparse.Namespace, log_dir: Path,
                   kill: bool) -> dict[str, Any]:
    """One configuration: the conversations' turns; with ``kill``, the first half of the
    turns, then the replica that served most is killed (SIGKILL) and counted DOWN by
    HAProxy, then the rest."""
    settings: dict[str, object] = {"model": args.model} if args.model else {}
    if args.cache_blocks:
        settings["cache_blocks"] = args.cache_blocks
    # One torch thread a replica: three replicas on a small machine share its cores.
    async with open_cluster(args.replicas, log_dir=log_dir, settings=settings,
                            env={"OMP_NUM_THREADS": str(args.threads)},
                            haproxy_cfg=cfg) as cluster:
        model = await served_model(cluster)
        conversations = [Conversation(cluster.url, model, i, args.answer, args.rules)
                         for i in range(args.conversations)]
        half = args.turns // 2 if kill else args.turns
        await take_turns(conversations, 1, half, args.concurrency, False, args.interleave)
        victim = None
        if kill:
            served = Counter(t.replica for c in conversations for t in c.turns if t.ok)
            victim = str(served.most_common(1)[0][0])
            next(r for r in cluster.replicas if r.name == victim).kill()
            await cluster.wait_in_pool(victim, up=False)
            await take_turns(conversations, half + 1, args.turns, args.concurrency, True,
                             args.interleave)
    turns = [t for c in conversations for t in c.turns]
    result = summary(turns, args.replicas)
    result["turns"] = [asdict(t) for t in turns]
    if victim is not None:
        result["killed"] = {"replica": victim, **moved(turns, victim)}
    return result


async def served_model(cluster: Cluster) -> str:
    async with httpx.AsyncClient(base_url=cluster.url, trust_env=False) as client:
        listing = (await client.get("/v1/models")).json()
    name: str = listing["data"][0]["id"]
    return name


def moved(turns: list[Turn], victim: str) -> dict[str, Any]:
    """Of the conversations on ``victim`` before the kill: where their later turns went,
    and whether they were cached again from their second turn after the move."""
    by_conversation: dict[int, list[Turn]] = {}
    for t in turns:
        by_conversation.setdefault(t.conversation, []).append(t)
    moved_to, cached_again = {}, []
    for index, ts in by_conversation.items():
        before = [t for t in ts if t.ok and not t.after_kill]
        after = [t for t in ts if t.ok and t.after_kill]
        if before and before[-1].replica == victim:
            moved_to[index] = sorted({str(t.replica) for t in after})
            cached_again += [t.cached_tokens > 0 for t in after[1:]]
    return {"conversations": len(moved_to), "landed_on": moved_to,
            "one_replica_each": all(len(v) == 1 for v in moved_to.values()),
            "cached_from_the_second_turn_after": all(cached_again) if cached_again else None}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fleetbench-") as tmp:
        directory = Path(tmp)
        least = await run_once(least_connections_cfg(directory), args, directory / "least",
                               False)
        affinity = await run_once(HAPROXY_CFG, args, directory / "affinity", False)
        killed = await run_once(HAPROXY_CFG, args, directory / "killed", True)
    keys = ("cached_over_prompt_turn2plus",)
    return {
        "command": "python -m tools.fleetbench " + " ".join(args.argv),
        "replicas": args.replicas, "conversations": args.conversations, "turns": args.turns,
        "least_connections": least, "affinity": affinity, "affinity_replica_killed": killed,
        "ratios": {
            "ttft_p50_turn2plus_least_over_affinity": _ratio(
                least["ttft_ms_turn2plus"]["p50"], affinity["ttft_ms_turn2plus"]["p50"]),
            **{f"{k}_affinity": affinity[k] for k in keys},
            **{f"{k}_least": least[k] for k in keys},
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.fleetbench", description=__doc__)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer", type=int, default=24, help="output tokens per turn")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--rules", type=int, default=DEFAULT_RULES,
                        help="rules in each conversation's instructions (about 40 tokens each)")
    parser.add_argument("--interleave", action="store_true",
                        help="turn k of every conversation before turn k + 1 of any")
    parser.add_argument("--cache-blocks", type=int, default=None,
                        help="STREAMSCOPE_CACHE_BLOCKS of each replica: a cache that holds "
                        "some of the conversations, not all (a fleet's real case)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--model", default=None, help="STREAMSCOPE_MODEL of the replicas")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


if __name__ == "__main__":
    import sys

    arguments = parse(sys.argv[1:])
    result = trio.run(main, arguments)
    text = json.dumps({k: v for k, v in result.items()}, indent=2, default=str)
    if arguments.json:
        arguments.json.write_text(text)
    print(json.dumps({k: result[k] for k in ("ratios",)}, indent=2))
    for name in ("least_connections", "affinity", "affinity_replica_killed"):
        print(name, json.dumps({k: v for k, v in result[name].items() if k != "turns"},
                               default=str))

"""What the Redis log of resumable streams costs per event (issue 11).

``python -m tools.redislogbench [--redis URL] [--json FILE]`` starts a redis-server on a
free loopback port (unless ``--redis`` names one; it must be empty or disposable: keys
``streamscope:{bench-*}`` are written and deleted) and measures, with events the size
of a token event of ``/v1/stream`` with resumable ids (~130 bytes):

* ``append_us``: the synchronous ``append`` on the event loop, per event, for the
  memory log and the Redis log (local copy + queued command): what the registry pays
  between taking an item and going on;
* ``burst``: S streams x E events appended at once, then flushed: wall time per event
  until Redis has them all (the writer's batches: one pipeline each);
* ``stepped``: S streams, one event each per "engine step" (every ``--step-ms``), the
  writer running beside: per event, the delay from ``append`` until a follower on
  another connection (XREAD BLOCK, as a remote reader) has it, p50/p99/max, and the
  batches the writer needed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import redis
import trio

from streams.resume import MemoryEventLog, RedisEventLog

SECRET = "redislogbench-" + "0" * 32  # what the replicas would share (it signs each event)
EVENT = (b'event: token\nid: 0123456789abcdef0123456789abcdef:17\n'
         b'data: {"index":15,"id":11234,"text":" Paris"}\n\n')  # a typical token event


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    process = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port),
                                "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    client.close()
    return process, f"redis://127.0.0.1:{port}/0"


def append_cost(log: Any, streams: int, events: int, tag: str) -> float:
    """Microseconds per sync append (nothing flushed meanwhile)."""
    start = time.perf_counter()
    for s in range(streams):
        for n in range(1, events + 1):
            log.append(f"bench-{tag}-{s}", n, EVENT, last=n == events)
    return (time.perf_counter() - start) / (streams * events) * 1e6


async def burst(url: str, streams: int, events: int) -> dict[str, Any]:
    log = RedisEventLog.from_url(url, secret=SECRET, ttl_s=60.0)
    start = time.perf_counter()
    append_us = append_cost(log, streams, events, "burst")
    await log.flush()
    wall = time.perf_counter() - start
    stats = log.statistics()
    for s in range(streams):
        log.expire(f"bench-burst-{s}")
    await log.flush()
    return {"streams": streams, "events": streams * events, "append_us": append_us,
            "us_per_event_until_in_redis": wall / (streams * events) * 1e6,
            "batches": stats.batches, "commands": stats.commands}


async def stepped(url: str, streams: int, steps: int, step_ms: float) -> dict[str, Any]:
    """One event per stream per step; a follower (another replica's reader) on stream 0."""
    log = RedisEventLog.from_url(url, secret=SECRET, ttl_s=60.0)
    follower = RedisEventLog.from_url(url, secret=SECRET, ttl_s=60.0)
    appended_at: dict[int, float] = {}
    delays: list[float] = []

    async def follow() -> None:
        position = 0
        while position < steps:
            got = await follower.read_remote("bench-step-0", position, wait_s=1.0) or []
            now = time.perf_counter()
            for n, _, _ in got:
                delays.append(now - appended_at[n])
                position = n

    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        log.append("bench-step-0", 1, EVENT)  # the key exists before the follower looks
        appended_at[1] = time.perf_counter()
        for s in range(1, streams):
            log.append(f"bench-step-{s}", 1, EVENT)
        nursery.start_soon(follow)
        for n in range(2, steps + 1):
            await trio.sleep(step_ms / 1000)
            appended_at[n] = time.perf_counter()
            for s in range(streams):
                log.append(f"bench-step-{s}", n, EVENT, last=n == steps)
        with trio.fail_after(30):
            while len(delays) < steps:  # noqa: ASYNC110
                await trio.sleep(0.01)
        for s in range(streams):
            log.expire(f"bench-step-{s}")
        await log.flush()
        nursery.cancel_scope.cancel()
    stats = log.statistics()
    delays_ms = sorted(d * 1000 for d in delays)
    return {"streams": streams, "steps": steps, "step_ms": step_ms,
            "events": streams * steps, "batches": stats.batches,
            "events_per_batch": streams * steps / max(stats.batches, 1),
            "follower_delay_ms": {
                "p50": statistics.median(delays_ms),
                "p99": delays_ms[min(len(delays_ms) - 1, int(len(delays_ms) * 0.99))],
                "max": delays_ms[-1]}}


async def main_async(url: str, args: argparse.Namespace) -> dict[str, Any]:
    memory_us = append_cost(MemoryEventLog(), 16, 1000, "memory")
    redis_log = RedisEventLog.from_url(url, secret=SECRET, ttl_s=60.0)
    redis_us = append_cost(redis_log, 16, 1000, "append")  # queued, never written
    return {
        "event_bytes": len(EVENT),
        "append_us": {"memory": memory_us, "redis": redis_us},
        "burst": await burst(url, 16, 500),
        "stepped": [await stepped(url, s, args.steps, args.step_ms) for s in (1, 16, 64)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", help="redis://host:port/db (default: start one)")
    parser.add_argument("--json", type=Path, default=Path("results/redislog.json"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    process = None
    url = args.redis
    if url is None:
        process, url = start_redis()
    try:
        result = trio.run(main_async, url, args)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=10)
    result["redis"] = "started on loopback" if process is not None else "given"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

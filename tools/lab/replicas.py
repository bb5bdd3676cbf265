"""``replicas``: one vs two replicas behind HAProxy, and a rolling restart under load.

Issue 11. The cluster is real processes on loopback (``tools/cluster.py``): a
``redis-server``, two ``streamscope serve`` replicas sharing it
(``STREAMSCOPE_RESUME_STORE``) and HAProxy running ``deploy/haproxy.cfg``. The lab's own
server (started as every lab experiment's, ``hypercorn -k trio app:app``, no Redis) is
the reference without a proxy ("direct").

What this machine can say. Its two cores are shared by both replicas, HAProxy, Redis and
the load generator (and by other work: the figures are ratios measured in one run): two
replicas cannot make more tokens per second than one here, since one replica already has
both cores while it steps. What can be measured is what the proxy costs (direct against
one replica behind HAProxy) and whether a rolling restart fails anything. On several
machines (one replica per GPU) throughput would add up to the number of replicas while
the proxy and Redis keep up (docs/results.md, "Several replicas").

Procedure. Throughput: ``--clients`` streams at once (default 16; quick 4), each of
``--tokens`` (32; quick 8) greedy tokens with ``ignore_eos``, four rounds of them
(``tools.load``, one connection per client); per repetition (``--repetitions``, 3;
quick 1) in turn: direct, one replica behind HAProxy (replica b disabled on HAProxy's
admin socket: the same processes and proxy), two replicas. Medians over the
repetitions of tokens/s (tokens over the run's makespan), TTFT p50 and p99.

Rolling restart, twice: as docs/deploy.md says (each replica out of HAProxy's pool first with
``set server replicas/X state drain`` on its runtime API, then SIGTERM), and with SIGTERM
alone (HAProxy takes the draining replica out when two checks of ``/ready`` have said
503). Each time the same load runs through HAProxy, half of the streams resumable,
with the load tool's retries (``Retries``: a refusal before the first byte with
``Retry-After`` or a connection refused, sent again up to 8 times; a resumable stream
cut before its final event resumed up to 3 times), while replica a and then b each
get SIGTERM, drain, exit, start again and are back in HAProxy's pool; then the load
stops sending and its open streams finish. Counted: streams sent, completed (every one
that ended with its final ``done``), retried (completed after a refusal sent again),
resumed (completed after a cut), failed (anything else); and per replica how long it
took to exit, to be ready again, and to be back in the pool.

Summary: ``tokens_per_s_{direct,1,2}``, ``ttft_p50_{...}``, ``ttft_p99_{...}`` (ms),
``proxy_ratio`` (one replica behind HAProxy over direct, tokens/s),
``restart_{streams,completed,retried,resumed,failed}``, ``restart_s`` per replica;
``sigterm_only_{...}`` the same for SIGTERM alone, ``sigterm_only_exit_s``.
Plot: tokens/s and TTFT per condition; the rolling restart's completions over time with
each replica's SIGTERM and return.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import trio

from tools.cluster import Cluster, open_cluster
from tools.lab.common import Lab, Report, experiment
from tools.load_runner import run_streams
from tools.records import LoadResult, StreamRequest
from tools.stream_client import Retries

RESTART_RETRIES = Retries(refusals=8, resumes=3, max_wait_s=1.0)
ROUNDS = 4  # streams per client in a throughput run


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=None, help="streams at once (16)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens a stream (32)")
    parser.add_argument("--repetitions", type=int, default=None, help="of each condition (3)")


async def _throughput(url: str, lab: Lab, clients: int, tokens: int) -> LoadResult:
    requests = [StreamRequest(p, tokens, True) for p in lab.prompts(clients * ROUNDS)]
    return await run_streams(url, requests, clients=clients, progress=False)


async def _set_enabled(cluster: Cluster, name: str, enabled: bool) -> None:
    """HAProxy's ``enable server`` / ``disable server`` on its admin socket."""
    import socket

    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        await sock.connect(str(cluster.admin_socket))
        verb = "enable" if enabled else "disable"
        await sock.send(f"{verb} server replicas/{name}\n".encode())
        while await sock.recv(4096):
            pass
    if enabled:
        await cluster.wait_in_pool(name)


async def _rolling_restart(cluster: Cluster, lab: Lab, clients: int, tokens: int, *,
                           haproxy_drain: bool) -> dict[str, Any]:
    requests = [StreamRequest(p, tokens, True, resumable=i % 2 == 0)
                for i, p in enumerate(lab.prompts(20_000))]
    stop_sending = trio.Event()
    result: LoadResult | None = None
    marks: list[dict[str, Any]] = []
    origin = time.perf_counter()

    async def load() -> None:
        nonlocal result
        result = await run_streams(cluster.url, requests, clients=clients, progress=False,
                                   stop_sending=stop_sending, retries=RESTART_RETRIES)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(load)
        await trio.sleep(1.0)  # the load runs before the first SIGTERM
        for replica in cluster.replicas:
            began = time.perf_counter()
            restart = await cluster.restart(replica, haproxy_drain=haproxy_drain)
            marks.append({"replica": replica.name, "sigterm_s": round(began - origin, 3),
                          "exit_code": restart.exit_code, "exited_s": restart.exited_s,
                          "ready_s": restart.ready_s, "in_pool_s": restart.in_pool_s})
        await trio.sleep(1.0)  # and after the last is back
        stop_sending.set()
    assert result is not None
    records = result.records
    return {
        "streams": len(records),
        "completed": sum(r.ok for r in records),
        "retried": sum(r.ok and r.retries > 0 for r in records),
        "resumed": sum(r.ok and r.resumes > 0 for r in records),
        "failed": sum(not r.ok for r in records),
        "failures": [{"index": r.index, "status": r.status, "error": r.error,
                      "retried": r.retried} for r in records if not r.ok][:20],
        "retried_for": [w for r in records for w in r.retried][:50],
        "restarts": marks,
        "origin_offset_s": round(origin - result.started_at, 3),
        "done_s": sorted(round(r.finished_at - origin, 3) for r in records
                         if r.ok and r.finished_at is not None),
        "retried_s": sorted(round(r.sent_at - origin, 3) for r in records
                            if (r.retries or r.resumes) and r.sent_at is not None),
        "summary": result.summary(),
    }


@experiment("replicas", "1 vs 2 replicas behind HAProxy; a rolling restart under load",
            server={"model": "tiny-gpt2", "device": "cpu", "threads": 1},
            arguments=arguments)
async def replicas(lab: Lab) -> Report:
    clients = lab.option("clients", 16, 4)
    tokens = lab.option("tokens", 32, 8)
    repetitions = lab.option("repetitions", 3, 1)
    threads = lab.server_settings.get("threads") or 1
    settings = {k: v for k, v in lab.server_settings.items() if k != "threads"}
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "1": [], "2": []}
    with TemporaryDirectory(prefix="streamscope-replicas-") as logs:
        async with open_cluster(2, log_dir=Path(logs), settings=settings,
                                env={"OMP_NUM_THREADS": str(threads)}) as cluster:
            await _throughput(cluster.url, lab, clients, tokens)  # warm both replicas
            await _throughput(lab.url, lab, clients, tokens)  # and the direct one
            for _ in range(repetitions):
                runs["direct"].append((await _throughput(lab.url, lab, clients,
                                                         tokens)).summary())
                await _set_enabled(cluster, "b", False)
                runs["1"].append((await _throughput(cluster.url, lab, clients,
                                                    tokens)).summary())
                await _set_enabled(cluster, "b", True)
                runs["2"].append((await _throughput(cluster.url, lab, clients,
                                                    tokens)).summary())
            restart = await _rolling_restart(cluster, lab, clients, tokens,
                                             haproxy_drain=True)
            sigterm_only = await _rolling_restart(cluster, lab, clients, tokens,
                                                  haproxy_drain=False)

    def med(condition: str, key: str) -> float | None:
        values = [r[key] for r in runs[condition] if r[key] is not None]
        return round(statistics.median(values), 2) if values else None

    summary: dict[str, Any] = {}
    for figure, key in (("tokens_per_s", "tokens_per_s"), ("ttft_p50", "ttft_p50_ms"),
                        ("ttft_p99", "ttft_p99_ms")):
        for condition in runs:
            summary[f"{figure}_{condition}"] = med(condition, key)
    direct, one = summary["tokens_per_s_direct"], summary["tokens_per_s_1"]
    summary["proxy_ratio"] = round(one / direct, 3) if direct and one else None
    for key in ("streams", "completed", "retried", "resumed", "failed"):
        summary[f"restart_{key}"] = restart[key]
    summary["restart_s"] = {m["replica"]: {"exit": m["exited_s"], "ready": m["ready_s"],
                                           "in_pool": m["in_pool_s"]}
                            for m in restart["restarts"]}
    for key in ("streams", "completed", "retried", "resumed", "failed"):
        summary[f"sigterm_only_{key}"] = sigterm_only[key]
    summary["sigterm_only_exit_s"] = {m["replica"]: m["exited_s"]
                                      for m in sigterm_only["restarts"]}
    summary["streams_errors"] = sum(r["errors"] for rs in runs.values() for r in rs)
    summary.update(clients=clients, tokens=tokens, repetitions=repetitions,
                   threads_per_replica=threads)
    raw = {"runs": runs, "rolling_restart": restart, "sigterm_only": sigterm_only}
    return Report(summary=summary, raw=raw, plot=lambda fig: _draw(fig, summary, restart))


def _draw(fig: Any, summary: dict[str, Any], restart: dict[str, Any]) -> None:
    fig.set_size_inches(13, 4)
    rate, ttft, timeline = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 2]})
    labels = ["direct", "1 behind\nHAProxy", "2 behind\nHAProxy"]
    conditions = ["direct", "1", "2"]
    rate.bar(labels, [summary[f"tokens_per_s_{c}"] or 0 for c in conditions],
             color=["grey", "tab:blue", "tab:green"])
    rate.set_ylabel("tokens/s (all streams)")
    rate.set_title("throughput (2 shared cores)")
    xs = range(len(conditions))
    ttft.bar([x - 0.2 for x in xs], [summary[f"ttft_p50_{c}"] or 0 for c in conditions],
             width=0.4, label="p50")
    ttft.bar([x + 0.2 for x in xs], [summary[f"ttft_p99_{c}"] or 0 for c in conditions],
             width=0.4, label="p99")
    ttft.set_xticks(list(xs), labels)
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_title("time to first token")
    ttft.legend()
    done = restart["done_s"]
    if done:
        timeline.hist(done, bins=max(10, int(done[-1] / 0.5)), color="tab:green",
                      label="streams completed (per 0.5 s)")
    for mark in restart["restarts"]:
        term = mark["sigterm_s"]
        timeline.axvline(term, color="tab:red", linestyle="--")
        timeline.axvline(term + mark["in_pool_s"], color="tab:blue", linestyle=":")
        timeline.text(term, timeline.get_ylim()[1] * 0.95, f" SIGTERM {mark['replica']}",
                      color="tab:red", fontsize=8, va="top")
    for t in restart["retried_s"]:
        timeline.axvline(t, color="tab:orange", alpha=0.3, linewidth=0.8)
    timeline.set_xlabel("s; dashed: SIGTERM, dotted: back in the pool, orange: a retry")
    timeline.set_title(f"rolling restart: {restart['completed']}/{restart['streams']} "
                       f"completed, {restart['retried'] + restart['resumed']} retried, "
                       f"{restart['failed']} failed")
    timeline.legend(loc="lower right", fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.15, wspace=0.3)

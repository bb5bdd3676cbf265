"""A rolling restart under load fails no request (issue 11), and ``/ready`` follows Redis.

Real processes (``tools/cluster.py``): a ``redis-server``, two ``streamscope serve``
replicas on the tiny model sharing it (``STREAMSCOPE_RESUME_STORE``), and HAProxy
running ``deploy/haproxy.cfg``. ``tools.load`` sends short streams through HAProxy, half
of them resumable, retrying what a client may retry (a refusal before the first byte
with ``Retry-After``, a connection refused; a resumable stream cut before its final
event, by ``Last-Event-ID``), while each replica in turn is restarted as docs/deploy.md
("Several replicas") says: out of HAProxy's pool (``set server ... state drain`` on its
runtime API), SIGTERM (it drains and exits 0), started again, ready, back in the pool.
Meanwhile a resumable stream that one replica generates is read on the replica being
restarted (a remote reader of the shared log):
the drain ends that read at once, without a final event, and the client resumes it
through HAProxy on the other replica, which completes it with the same tokens. And a
long resumable stream that the second replica generates and its client reads there
spans that replica's restart: its drain (a short grace period) hands it over, the body
ends without a final event, and the client's resume through HAProxy continues it on
the first replica with the same tokens.

Missing ``redis-server`` or ``haproxy`` FAILS the test with the command that installs it.
The only waits are polls for a process, an HTTP answer or HAProxy's view of a replica.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import httpx
import trio

from app.runtime import HANDOVER_LEAD_S
from streams import ServerSentEvent, SSEParser
from tests.http_server import StartServer
from tests.test_replicas import RESUME_SECRET
from tools.cluster import Cluster, ClusterError, binary, free_port, open_cluster
from tools.load_runner import run_streams
from tools.records import StreamRequest
from tools.stream_client import Retries

# A short drain, of just HANDOVER_LEAD_S: the hand-over (that long before the deadline)
# comes at the signal, so the long stream read on its owner need not outlast a timer to
# be still running then (with 1 s, 281 of its 482 events were out at the hand-over here:
# a machine twice as fast would have finished it). The load's short streams, 12 tokens
# each, end in the 0.5 s (tens of milliseconds here).
# The default precision (bfloat16 on a CPU that has it): a rebuilt stream continues
# token for token there too (the recompute replays its tokens as decode rows).
SETTINGS = {"model": "tiny-gpt2", "device": "cpu", "cache_blocks": 256,
            "shutdown_grace_s": HANDOVER_LEAD_S}
ENV = {"OMP_NUM_THREADS": "1"}
TOKENS = 12  # a short stream: it ends well within a drain's grace period
LONG_TOKENS = 480  # the long streams: still running when the drain begins (512 at most)
CLIENTS = 3
PROMPTS = ["The rolling restart", "Two replicas behind", "A stream resumes on"]
WAIT_S = 30.0
RETRIES = Retries(refusals=8, resumes=3, max_wait_s=1.0)


def cluster_logs(tmp_path: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in sorted(tmp_path.glob("*.log")))


def parse(raw: bytes) -> list[ServerSentEvent]:
    parser = SSEParser()
    return parser.feed(raw) + parser.close()


def positions(events: list[ServerSentEvent]) -> list[int]:
    return [int(e.id.rpartition(":")[2]) for e in events]


def token_ids(events: list[ServerSentEvent]) -> list[int]:
    return [json.loads(e.data)["id"] for e in events if e.event == "token"]


class RemoteRead:
    """A stream replica ``owner`` generates (``POST /v1/requests``, no reader there),
    read on replica ``reader`` (which follows the shared log), then, once that read ends
    without a final event, resumed through HAProxy."""

    def __init__(self, cluster: Cluster, owner: str, reader: str) -> None:
        self.cluster = cluster
        self.owner = next(r for r in cluster.replicas if r.name == owner)
        self.reader = next(r for r in cluster.replicas if r.name == reader)
        self.request_id = ""
        self.first: list[ServerSentEvent] = []  # read on `reader`, until it ended
        self.rest: list[ServerSentEvent] = []  # read through HAProxy after the cut
        self.resume_refusals: list[int] = []
        self.reading = trio.Event()
        self.cut_at: float | None = None

    async def run(self) -> None:
        body = {"prompt": PROMPTS[0], "max_new_tokens": LONG_TOKENS, "ignore_eos": True,
                "temperature": 0.0}
        async with httpx.AsyncClient(timeout=WAIT_S, trust_env=False) as client:
            created = await client.post(self.owner.url + "/v1/requests", json=body)
            assert created.status_code == 201, created.text
            self.request_id = created.json()["id"]  # in Redis already: B finds it
            parser, raw = SSEParser(), b""
            async with client.stream("GET", f"{self.reader.url}/v1/stream/{self.request_id}"
                                     ) as response:
                assert response.status_code == 200
                async for chunk in response.aiter_raw():
                    raw += chunk
                    self.first += parser.feed(chunk)
                    if len(self.first) >= 3:
                        self.reading.set()
            self.cut_at = time.perf_counter()
            self.rest = await resume_through(client, self.cluster.url, self.request_id,
                                             self.first[-1].id, self.resume_refusals)


async def resume_through(client: httpx.AsyncClient, url: str, request_id: str, last: str,
                         refusals: list[int]) -> list[ServerSentEvent]:
    """The stream after event ``last``, resumed at ``url`` (HAProxy) until a 200 (one
    response, to its end); 503 and 409 tried again after their ``Retry-After`` (capped at
    0.2 s), as a client would, for as long as ``WAIT_S`` allows: a deadline, not a count
    of tries, so that a slower machine's takeover is waited for too."""
    answer = None
    with trio.move_on_after(WAIT_S):
        while (answer := await client.get(f"{url}/v1/stream/{request_id}",
                                          headers={"Last-Event-ID": last})
               ).status_code in (503, 409):
            refusals.append(answer.status_code)
            await trio.sleep(min(float(answer.headers.get("Retry-After", 0.1)), 0.2))
    assert answer is not None and answer.status_code == 200, answer and answer.text
    return parse(answer.content)


class OwnRead:
    """A long resumable stream that replica ``owner`` generates, read there
    (``POST /v1/stream``) until its body ends (the drain hands the stream over), then
    resumed through HAProxy."""

    def __init__(self, cluster: Cluster, owner: str) -> None:
        self.cluster = cluster
        self.owner = next(r for r in cluster.replicas if r.name == owner)
        self.first: list[ServerSentEvent] = []  # read on `owner`, until it ended
        self.rest: list[ServerSentEvent] = []  # read through HAProxy after the cut
        self.resume_refusals: list[int] = []
        self.reading = trio.Event()

    async def run(self) -> None:
        body = {"prompt": PROMPTS[0], "max_new_tokens": LONG_TOKENS, "ignore_eos": True,
                "temperature": 0.0, "resumable": True}
        async with httpx.AsyncClient(timeout=WAIT_S, trust_env=False) as client:
            parser = SSEParser()
            async with client.stream("POST", self.owner.url + "/v1/stream",
                                     json=body) as response:
                assert response.status_code == 200
                request_id = response.headers["X-Request-ID"]
                async for chunk in response.aiter_raw():
                    self.first += parser.feed(chunk)
                    if len(self.first) >= 3:
                        self.reading.set()
            if self.first[-1].event in ("done", "error"):
                return  # it ended on its owner (the assertions say so)
            self.rest = await resume_through(client, self.cluster.url, request_id,
                                             self.first[-1].id, self.resume_refusals)


async def test_a_rolling_restart_under_load_fails_no_request(tmp_path: Path) -> None:
    try:
        async with open_cluster(2, log_dir=tmp_path, settings=SETTINGS, env=ENV) as cluster:
            await rolling_restart_under_load(cluster)
    except (AssertionError, ClusterError) as exc:
        raise AssertionError(f"{exc}\n{cluster_logs(tmp_path)}") from exc


async def rolling_restart_under_load(cluster: Cluster) -> None:
    a, b = cluster.replicas
    # The uninterrupted stream the remote read must equal (greedy: same prompt, same ids).
    async with httpx.AsyncClient(timeout=WAIT_S, trust_env=False) as client:
        whole = parse((await client.post(b.url + "/v1/stream", json={
            "prompt": PROMPTS[0], "max_new_tokens": LONG_TOKENS, "ignore_eos": True,
            "temperature": 0.0})).content)
    requests = [StreamRequest(PROMPTS[i % len(PROMPTS)], TOKENS, ignore_eos=True,
                              resumable=i % 2 == 0) for i in range(5000)]
    stop_sending = trio.Event()
    remote = RemoteRead(cluster, owner="b", reader="a")
    own = OwnRead(cluster, owner="b")
    windows: list[tuple[float, float]] = []
    result = None

    async def load() -> None:
        nonlocal result
        result = await run_streams(cluster.url, requests, clients=CLIENTS, progress=False,
                                   stop_sending=stop_sending, retries=RETRIES)

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load)
            nursery.start_soon(remote.run)
            await remote.reading.wait()
            for replica in (a, b):  # A first: its remote reader is cut by the drain
                if replica is b:  # B's own long stream, read on B, spans B's restart
                    nursery.start_soon(own.run)
                    await own.reading.wait()
                began = time.perf_counter()
                restart = await cluster.restart(replica)
                windows.append((began, time.perf_counter()))
                assert restart.exit_code == 0, restart
            stop_sending.set()
    assert result is not None
    records = result.records

    # Load ran across both restarts, and every stream completed.
    for began, ended in windows:
        assert any(began <= r.sent_at <= ended for r in records if r.sent_at), (began, ended)
    failed = [(r.index, r.status, r.error, r.retried) for r in records if not r.ok]
    assert failed == [], failed
    assert all(r.finish_reason == "length" and r.tokens == TOKENS for r in records)
    # What was retried was a refusal before the first byte, or a cut resumable stream.
    for r in records:
        for why in r.retried:
            assert why.startswith(("HTTP 503", "HTTP 429", "ConnectError", "cut after")), why
    # Greedy: streams of one prompt got the same tokens, retried, resumed or not.
    by_prompt: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for r in records:
        by_prompt[r.request.prompt].add(tuple(r.token_ids))
    assert all(len(ids) == 1 for ids in by_prompt.values()), by_prompt

    # The remote read on A ended at A's drain without a final event, and resumed through
    # HAProxy on B (A is going away), gap-free, with the uninterrupted stream's tokens.
    assert remote.first[-1].event == "token", remote.first[-1]
    # At once: the drain ends a remote read at its start, milliseconds after the restart
    # began here (HAProxy's drain state, then SIGTERM); 3 s is far from that 5x slower.
    assert remote.cut_at is not None and remote.cut_at - windows[0][0] < 3.0
    events = remote.first + remote.rest
    assert positions(events) == list(range(1, len(whole) + 1))
    assert [e.event for e in events] == [e.event for e in whole]
    assert token_ids(events) == token_ids(whole)

    # B's own long stream, read on B, was handed over by B's drain (its body ended
    # without a final event) and continued on A through HAProxy with the same tokens.
    assert own.first[-1].event == "token", own.first[-1]
    events = own.first + own.rest
    assert positions(events) == list(range(1, len(whole) + 1))
    assert [e.event for e in events] == [e.event for e in whole]
    assert token_ids(events) == token_ids(whole)


# -- /ready and Redis ----------------------------------------------------------------

def redis_command() -> tuple[str, list[str]]:
    """A redis-server's URL and command line, on a free loopback port, no persistence."""
    port = free_port()
    return f"redis://127.0.0.1:{port}/0", [
        binary("redis-server", "redis-server"), "--bind", "127.0.0.1", "--port", str(port),
        "--save", "", "--appendonly", "no"]


async def start_redis(command: list[str]) -> trio.Process:
    return await trio.lowlevel.open_process(command, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)


async def wait_status(client: httpx.AsyncClient, status: int) -> httpx.Response:
    with trio.fail_after(WAIT_S):
        while True:
            response = await client.get("/ready")
            if response.status_code == status:
                return response
            await trio.sleep(0.05)


async def test_ready_is_503_while_redis_does_not_answer(start_server: StartServer) -> None:
    """Redis stops: /ready says 503 (HAProxy takes the replica out: a resume of another
    replica's stream would fail here), /health still 200; Redis back: ready again."""
    url, command = redis_command()
    redis_process = await start_redis(command)
    try:
        server = await start_server(resume_store=url, resume_secret=RESUME_SECRET)
        async with server.client() as client:
            up = await wait_status(client, 200)
            redis_process.terminate()  # Redis stops
            await redis_process.wait()
            down = await client.get("/ready")
            health = await client.get("/health")
            redis_process = await start_redis(command)
            back = await wait_status(client, 200)  # Redis again: ready again
    finally:
        redis_process.kill()
        await redis_process.wait()

    assert up.json()["status"] == "ready"
    assert down.status_code == 503
    assert down.json()["error"]["type"] == "unavailable"
    assert "STREAMSCOPE_RESUME_STORE" in down.json()["error"]["message"]
    assert down.headers["Retry-After"] == "1"
    assert health.status_code == 200  # the process is fine: only not ready
    assert back.json()["status"] == "ready"

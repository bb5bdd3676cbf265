"""HTTP/2 to HAProxy, HTTP/1.1 to the replicas (issue 25, item 5): ``deploy/haproxy.cfg``'s
TLS frontend (``alpn h2,http/1.1``), real ``haproxy`` on loopback in front of two
in-process replicas, a certificate made by ``openssl`` at test time.

A client's RST_STREAM reaches the replica as a disconnect (HAProxy aborts that stream's
HTTP/1.1 request: the replica's connection closes), so its sequence is cancelled within
a step; and the streams of one client connection are spread over the replicas.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from engine import FinishReason
from tests.http2_clients import H2Client
from tests.http_clients import long_body, stream_body
from tests.http_server import RunningServer, StartServer
from tests.test_replicas import DEPLOY, binary, free_port
from tests.tls import Certificate

START_S = 10.0
TOKENS_READ = 3
CONCURRENT = 32


@pytest.fixture
def haproxy_tls(
    certificate: Certificate, tmp_path: Path
) -> Iterator[Callable[[RunningServer, RunningServer], int]]:
    """``start(a, b)``: deploy/haproxy.cfg with its TLS frontend in front of two replicas;
    the TLS port."""
    processes: list[subprocess.Popen[bytes]] = []
    crt = tmp_path / "haproxy.pem"  # HAProxy's crt: the certificate and its key
    crt.write_bytes(certificate.cert.read_bytes() + certificate.key.read_bytes())

    def start(a: RunningServer, b: RunningServer) -> int:
        port = free_port()
        env = {**os.environ, "STREAMSCOPE_LB_BIND": f"127.0.0.1:{free_port()}",
               "STREAMSCOPE_LB_TLS_BIND": f"127.0.0.1:{port}", "STREAMSCOPE_LB_CERT": str(crt),
               "STREAMSCOPE_LB_REPLICA_A": f"{a.host}:{a.port}",
               "STREAMSCOPE_LB_REPLICA_B": f"{b.host}:{b.port}"}
        processes.append(subprocess.Popen(
            [binary("haproxy", "haproxy"), "-db", "-f", os.path.join(DEPLOY, "haproxy.cfg")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        return port

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


async def connect(port: int, certificate: Certificate) -> H2Client:
    """An HTTP/2 connection to HAProxy, once it listens."""
    with trio.fail_after(START_S):
        while True:
            try:
                return await H2Client.connect(("127.0.0.1", port), certificate)
            except OSError:
                await trio.sleep(0.01)  # until it listens


async def test_a_reset_stream_through_haproxy_is_cancelled_on_its_replica(
    start_server: StartServer, haproxy_tls: Callable[[RunningServer, RunningServer], int],
    certificate: Certificate,
) -> None:
    a, b = await start_server(), await start_server()
    client = await connect(haproxy_tls(a, b), certificate)
    gone, neighbour = [await client.post("/v1/stream", long_body()) for _ in range(2)]
    await client.read_until(lambda: len(gone.tokens()) >= TOKENS_READ)
    request_id = gone.request_id()
    replica = a if request_id in a.recorder.submitted else b
    replica.recorder.hold()  # it cannot end before the replica notices

    await client.reset(gone)
    await replica.wait_for(lambda: request_id in replica.recorder.cancel_marks, "the cancel")
    replica.recorder.release()
    finish = await replica.wait_finished(request_id)

    assert finish.reason is FinishReason.CANCELLED
    assert finish.completion_tokens <= replica.recorder.cancel_marks[request_id] + 1
    await client.read_until(lambda: neighbour.ended)  # its neighbour was not touched
    assert neighbour.events[-1].event == "done"
    await client.close_clean()


async def test_the_streams_of_one_connection_spread_over_the_replicas(
    start_server: StartServer, haproxy_tls: Callable[[RunningServer, RunningServer], int],
    certificate: Certificate,
) -> None:
    a, b = await start_server(max_batch=8), await start_server(max_batch=8)
    client = await connect(haproxy_tls(a, b), certificate)
    streams = [client.start_post("/v1/stream", stream_body(max_new_tokens=24, ignore_eos=True))
               for _ in range(CONCURRENT)]
    await client.flush()

    await client.read_until(lambda: all(s.done for s in streams))

    assert all(s.status == 200 and s.events[-1].event == "done" for s in streams)
    on_a, on_b = len(a.recorder.submitted), len(b.recorder.submitted)
    assert on_a + on_b == CONCURRENT
    assert min(on_a, on_b) >= CONCURRENT // 4, (on_a, on_b)  # leastconn: near half each
    await client.close_clean()

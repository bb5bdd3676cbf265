"""What the proxy in front must do (issue 23, items 3 and 6): ``deploy/haproxy.cfg``
limits each source address's connections and request rate, and neither it nor
``deploy/nginx.conf`` writes a query string (a stream's read token) to its access log.

Real ``haproxy`` and ``nginx`` on loopback ports in front of an in-process replica; a
missing binary FAILS the test with the command that installs it (CI installs both).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.http_server import RunningServer
from tests.test_nginx import Nginx, deploy_conf, nginx  # noqa: F401 - the fixture
from tests.test_replicas import DEPLOY, binary, free_port

START_S = 10.0
SECRET = "1767225600.0123456789abcdef-the-read-token"


@pytest.fixture
def haproxy_with() -> Iterator[Callable[..., tuple[str, subprocess.Popen[bytes]]]]:
    """``start(server, **env)``: deploy/haproxy.cfg in front of ``server`` (as both of its
    replicas) with ``env`` added; its base URL and process."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(server: RunningServer, **env: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        replica = f"{server.host}:{server.port}"
        process = subprocess.Popen(
            [binary("haproxy", "haproxy"), "-db", "-f", os.path.join(DEPLOY, "haproxy.cfg")],
            env={**os.environ, "STREAMSCOPE_LB_BIND": f"127.0.0.1:{port}",
                 "STREAMSCOPE_LB_REPLICA_A": replica, "STREAMSCOPE_LB_REPLICA_B": replica, **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        processes.append(process)
        return f"http://127.0.0.1:{port}", process

    yield start
    for process in processes:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=10)


async def wait_listening(base_url: str) -> None:
    """Until the proxy accepts connections (a bare connect: no request counted)."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    with trio.fail_after(START_S):
        while True:
            try:
                await (await trio.open_tcp_stream(host, int(port))).aclose()
                return
            except OSError:
                await trio.sleep(0.01)  # until it listens


def test_deploy_haproxy_cfg_is_valid_as_shipped() -> None:
    env = {**os.environ, "STREAMSCOPE_LB_BIND": "127.0.0.1:8080",
           "STREAMSCOPE_LB_REPLICA_A": "127.0.0.1:8001",
           "STREAMSCOPE_LB_REPLICA_B": "127.0.0.1:8002"}
    done = subprocess.run([binary("haproxy", "haproxy"), "-c", "-f",
                           os.path.join(DEPLOY, "haproxy.cfg")],
                          env=env, capture_output=True, text=True, check=False)

    assert done.returncode == 0, done.stdout + done.stderr


async def test_haproxy_refuses_a_source_past_its_open_connections(
    server: RunningServer, haproxy_with: Callable[..., tuple[str, subprocess.Popen[bytes]]],
) -> None:
    base_url, _ = haproxy_with(server, STREAMSCOPE_LB_CONN_PER_IP="2")
    await wait_listening(base_url)
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    held = []
    for _ in range(2):  # each answered, so HAProxy has accepted (counted) it; kept alive
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(START_S):
            assert (await stream.receive_some()).startswith(b"HTTP/1.1 200")
        held.append(stream)
    with trio.fail_after(START_S):
        try:
            third = await trio.open_tcp_stream(host, int(port))
            await third.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await third.receive_some()
            await third.aclose()
        except (OSError, trio.BrokenResourceError):  # reset at accept
            answer = b""
    for stream in held:
        await stream.aclose()
    async with httpx.AsyncClient(base_url=base_url, timeout=START_S) as client:
        with trio.fail_after(START_S):
            while (after := await client.get("/health")).status_code != 200:  # noqa: ASYNC110
                await trio.sleep(0.01)  # until HAProxy saw the two close

    assert answer == b""  # closed without an answer: the replica never saw it
    assert after.status_code == 200


async def test_haproxy_answers_429_past_a_source_s_request_rate(
    server: RunningServer, haproxy_with: Callable[..., tuple[str, subprocess.Popen[bytes]]],
) -> None:
    base_url, _ = haproxy_with(server, STREAMSCOPE_LB_REQUESTS_PER_10S="3")
    await wait_listening(base_url)
    async with httpx.AsyncClient(base_url=base_url, timeout=START_S) as client:
        answers = [await client.get("/health") for _ in range(6)]
    codes = [a.status_code for a in answers]

    # At most 3 in 10 s; wait_listening's bare connection may have counted as one.
    assert codes[:2] == [200, 200] and codes[-3:] == [429, 429, 429], codes
    assert codes == sorted(codes)
    refused = answers[-1]
    assert refused.headers["content-type"] == "application/json"
    assert refused.json()["error"]["type"] == "too_many_requests"
    assert int(refused.headers["retry-after"]) >= 1


async def test_haproxy_logs_no_query_string(
    server: RunningServer, haproxy_with: Callable[..., tuple[str, subprocess.Popen[bytes]]],
) -> None:
    base_url, process = haproxy_with(server)
    await wait_listening(base_url)
    async with httpx.AsyncClient(base_url=base_url, timeout=START_S) as client:
        answer = await client.get(f"/v1/stream/0123456789abcdef?token={SECRET}")
    process.terminate()
    log = process.communicate(timeout=10)[0].decode(errors="replace")

    assert answer.status_code == 204
    assert '"GET /v1/stream/0123456789abcdef HTTP/1.1"' in log, log
    assert "token" not in log and SECRET not in log


async def test_nginx_logs_no_query_string(
    server: RunningServer, nginx: Nginx, tmp_path: Path,  # noqa: F811
) -> None:
    conf = deploy_conf()
    assert "access_log /dev/stdout streamscope;" in conf
    access_log = tmp_path / "access.log"
    base_url = await nginx(conf.replace("/dev/stdout", str(access_log)), server, server)
    async with httpx.AsyncClient(base_url=base_url, timeout=START_S) as client:
        answer = await client.get(f"/v1/stream/0123456789abcdef?token={SECRET}")
    with trio.fail_after(START_S):
        while "/v1/stream/" not in access_log.read_text():  # noqa: ASYNC110
            await trio.sleep(0.01)  # nginx writes its line after the response
    log = access_log.read_text()

    assert answer.status_code == 204
    assert '"GET /v1/stream/0123456789abcdef HTTP/1.1" 204' in log, log
    assert "token" not in log and SECRET not in log

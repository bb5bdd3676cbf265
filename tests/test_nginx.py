"""nginx in front of the server, the real one: its default proxy settings and
``deploy/nginx.conf``.

With its defaults nginx speaks HTTP/1.0 to the upstream and buffers the response, so an
SSE response (no Content-Length) ends only when the server closes the connection: the
server that did not close after an HTTP/1.0 request (issue 8) left every stream hanging
after ``done`` until nginx's 60 s ``proxy_read_timeout``, which then ended it in an error.
``deploy/nginx.conf`` is what docs/deploy.md offers for several replicas: HTTP/1.1 upstream
with keep-alive, no buffering; a client that leaves must still reach the replica as a
disconnect (nginx closes the upstream connection), so that its blocks are released.

A missing ``nginx`` FAILS the test with the command that installs it (CI installs it).
The servers are in-process hypercorn servers on the tiny model (``tests/http_server.py``),
which check at teardown that every stream closed and the cache is whole.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.http_clients import RawClient, long_body, parse_sse, stream_body
from tests.http_server import RunningServer, StartServer
from tests.test_replicas import DEPLOY, binary, free_port

TOKENS = 8
# A safety net: a stream through nginx ends within milliseconds of its done; a hang
# lasts nginx's proxy_read_timeout, 60 s by default.
STREAM_END_S = 10.0
START_S = 10.0

# Everything about proxying left at nginx's defaults (HTTP/1.0, buffering on, 60 s).
DEFAULTS_CONF = """
worker_processes 1;
pid {tmp}/nginx.pid;
daemon off;
events { worker_connections 64; }
http {
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    server {
        listen 127.0.0.1:{port};
        location / { proxy_pass http://{a}; }
    }
}
"""

Nginx = Callable[[str, RunningServer, RunningServer], Awaitable[str]]


def deploy_conf() -> str:
    """``deploy/nginx.conf`` with placeholders for its listen and server lines and its
    pid and temp paths."""
    text = Path(DEPLOY, "nginx.conf").read_text()
    for old, new in (("listen 127.0.0.1:8080;", "listen 127.0.0.1:{port};"),
                     ("server 127.0.0.1:8001 ", "server {a} "),
                     ("server 127.0.0.1:8002 ", "server {b} "),
                     ("/tmp/streamscope-nginx", "{tmp}/nginx")):
        assert old in text, f"deploy/nginx.conf has no {old!r} any more"
        text = text.replace(old, new)
    return text


def _fill(conf: str, **values: str) -> str:
    for name, value in values.items():
        conf = conf.replace("{" + name + "}", value)
    return conf


@pytest.fixture
async def nginx(tmp_path: Path) -> AsyncIterator[Nginx]:
    """``await start(conf, a, b)``: nginx running ``conf`` (``{port}``, ``{a}``, ``{b}``,
    ``{tmp}`` filled in) on a free port; its base URL once it accepts connections."""
    processes: list[trio.Process] = []

    async def start(conf: str, a: RunningServer, b: RunningServer) -> str:
        port = free_port()
        path = tmp_path / "nginx.conf"
        path.write_text(_fill(conf, port=str(port), tmp=str(tmp_path), a=f"{a.host}:{a.port}",
                              b=f"{b.host}:{b.port}"))
        command = [binary("nginx", "nginx"), "-e", str(tmp_path / "error.log"), "-c", str(path)]
        checked = await trio.run_process([*command, "-t"], capture_stderr=True, check=False)
        assert checked.returncode == 0, checked.stderr
        processes.append(await trio.lowlevel.open_process(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with trio.fail_after(START_S):
            while True:
                try:
                    await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
                    return f"http://127.0.0.1:{port}"
                except OSError:
                    assert processes[-1].returncode is None, (tmp_path / "error.log").read_text()
                    await trio.sleep(0.01)  # until nginx listens

    yield start
    for process in processes:
        process.terminate()
        with trio.fail_after(START_S):
            await process.wait()


async def _stream(client: httpx.AsyncClient, **fields: Any) -> list[str]:
    """One stream's token texts; it must end with ``done``."""
    with trio.fail_after(STREAM_END_S):
        response = await client.post("/v1/stream", json=stream_body(**fields))
    events = parse_sse(response.content)
    assert response.status_code == 200 and events[-1].event == "done", events[-3:]
    return [e.data for e in events if e.event == "token"]


async def test_nginx_with_its_default_proxy_settings_ends_each_stream_at_done(
    server: RunningServer, nginx: Nginx,
) -> None:
    url = await nginx(DEFAULTS_CONF, server, server)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=STREAM_END_S) as direct:
        expected = await _stream(direct, max_new_tokens=TOKENS, ignore_eos=True)
    async with httpx.AsyncClient(base_url=url, timeout=STREAM_END_S) as client:
        for _ in range(3):
            assert await _stream(client, max_new_tokens=TOKENS, ignore_eos=True) == expected


async def test_deploy_nginx_conf_streams_whole_answers_from_both_replicas(
    start_server: StartServer, nginx: Nginx,
) -> None:
    a, b = await start_server(), await start_server()
    url = await nginx(deploy_conf(), a, b)
    async with httpx.AsyncClient(base_url=a.base_url, timeout=STREAM_END_S) as direct:
        expected = await _stream(direct, max_new_tokens=TOKENS, ignore_eos=True)
    opened = [s.hub.statistics().opened for s in (a, b)]
    async with httpx.AsyncClient(base_url=url, timeout=STREAM_END_S) as client:
        async with trio.open_nursery() as nursery:  # two at once: least_conn spreads them
            for _ in range(2):
                nursery.start_soon(_expect_stream, client, expected)
        for _ in range(4):
            await _expect_stream(client, expected)
    served = [s.hub.statistics().opened - before for s, before in zip((a, b), opened,
                                                                        strict=True)]
    assert sum(served) == 6 and min(served) > 0, served


async def _expect_stream(client: httpx.AsyncClient, expected: list[str]) -> None:
    assert await _stream(client, max_new_tokens=TOKENS, ignore_eos=True) == expected


@pytest.mark.parametrize("leave", ["fin", "rst"])
async def test_a_client_that_leaves_through_deploy_nginx_conf_frees_its_stream(
    start_server: StartServer, nginx: Nginx, leave: str,
) -> None:
    a, b = await start_server(), await start_server()
    url = await nginx(deploy_conf(), a, b)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = RawClient(host, int(port))
    await client.post("/v1/stream", long_body())
    await client.read_tokens(2)  # the stream runs on one replica
    for replica in (a, b):  # it cannot end on its own before the disconnect reaches it
        replica.recorder.hold()
    owner = next(s for s in (a, b) if s.hub.statistics().streams_open)
    request_id = client.request_id()
    if leave == "fin":
        client.sock.shutdown(trio.socket.SHUT_WR)  # nginx takes EOF for the client gone
    else:
        client.close_abort()
    await owner.wait_for(lambda: request_id in owner.recorder.cancel_marks,
                         "the disconnect to reach the replica")
    for replica in (a, b):
        replica.recorder.release()
    await owner.wait_finished(request_id)
    if leave == "fin":
        client.sock.close()
    finish = owner.recorder.finish_of(request_id)
    assert finish is not None and finish.reason.value == "cancelled", finish
    await owner.wait_for(lambda: owner.hub.statistics().streams_open == 0,
                         "the replica to close the stream")
    stats = owner.recorder.statistics()
    assert stats.blocks_free == stats.blocks_total


async def test_deploy_nginx_conf_keeps_a_session_on_one_replica_and_names_it(
    start_server: StartServer, nginx: Nginx,
) -> None:
    a, b = await start_server(), await start_server()
    url = await nginx(deploy_conf(), a, b)
    addresses = {f"{a.host}:{a.port}", f"{b.host}:{b.port}"}
    async with httpx.AsyncClient(base_url=url, timeout=STREAM_END_S) as client:
        placed: dict[str, set[str]] = {}
        for session in [f"session-{n}" for n in range(6)] * 3:
            response = await client.post("/v1/generate", headers={"x-session-id": session},
                                         json=stream_body(max_new_tokens=1))
            assert response.status_code == 200
            placed.setdefault(session, set()).add(response.headers["streamscope-replica"])

    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    assert set().union(*placed.values()) <= addresses


def test_deploy_nginx_conf_is_valid_as_shipped() -> None:
    nginx_binary = binary("nginx", "nginx")
    done = subprocess.run([nginx_binary, "-t", "-c", os.path.join(DEPLOY, "nginx.conf")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr

"""The drain on SIGTERM, end to end: a real ``hypercorn -k trio app:app`` process, real signals.

Each test starts the command-line server on the tiny model and holds two streams open
with readers that do not read: padded token events (the lab's server,
``STREAMSCOPE_LAB_PAD_BYTES``) fill
the socket buffers, so both streams pause in the engine (``paused_streams`` 2) with many
tokens to go, however fast the model is. Then a signal. The short stream's reader reads
at once: it must finish with ``done``. The long one's reader waits until the server logs
that the drain is over: it must end with the hub's ``error`` event ``shutdown`` (the
hub's message, "the server is shutting down"; a stream that hypercorn's graceful timeout
cut would say "the server is stopping", ``connection.py``'s farewell). The process must
exit 0 after logging that its cache is whole.

An idle HTTP/2 connection (prior knowledge, in the clear) is open beside them: it must get
a GOAWAY ``NO_ERROR`` before the server closes it (``app/edge/h2_retire.py``), whichever
way the signal came.

Two ways the signal arrives (``app/edge/signals.py``): to the app's worker process (hypercorn
keeps accepting, so new requests and ``/ready`` are answered 503 with Retry-After while
the streams drain), and to hypercorn's main process, as ``docker stop`` does (hypercorn
stops accepting at once; the app learns of it through hypercorn's shutdown Event).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import trio

from tests.http_clients import RawClient, stream_body

REPO_ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 2.5  # STREAMSCOPE_SHUTDOWN_GRACE_S: the drain deadline, from the signal
# hypercorn's: at least the grace plus drain.DRAIN_MARGIN_S. It bounds the exit only if
# something is wrong: the process exits as soon as the last connection closes.
GRACEFUL_TIMEOUT_S = 6
# The stream that can finish: its reader reads at once. About five events fill the
# sockets before a stream pauses, so it is held; 24 events of 64 KiB read in well under
# the grace period even on a busy machine.
SHORT_TOKENS = 24
# Safety nets only: every wait is for a condition; these fire only if it never comes.
START_TIMEOUT_S = 120.0
WAIT_TIMEOUT_S = 15.0
POLL_S = 0.02
SERVER_ENV = {
    "STREAMSCOPE_MODEL": "tiny-gpt2",
    "STREAMSCOPE_DEVICE": "cpu",
    "STREAMSCOPE_CACHE_BLOCKS": "64",
    "STREAMSCOPE_SHUTDOWN_GRACE_S": str(GRACE_S),
    "STREAMSCOPE_QUEUE_LIMIT": "4",  # a blocked writer pauses its stream soon
    "STREAMSCOPE_STALL_TIMEOUT_S": "60",  # never drop a reader here
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
# The lab's server (tools/lab/_app.py: the service plus its devices): each token event is
# followed by 64 KiB of padding, so that a reader that does not read blocks the writer soon.
LAB_ENV = {"STREAMSCOPE_LAB_PAD_BYTES": str(64 * 1024)}
_RUNNING_ON = re.compile(r"\[(\d+)\] \[INFO\] Running on http://127\.0\.0\.1:(\d+)")


@dataclass
class Server:
    proc: trio.Process
    log_path: Path
    worker_pid: int  # hypercorn's spawned worker: the app's process
    port: int

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", trust_env=False,
                                 timeout=WAIT_TIMEOUT_S)

    async def wait_for(
        self, condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_TIMEOUT_S
    ) -> None:
        """Poll ``condition`` (an HTTP answer or the log has no event to wait on)."""
        try:
            with trio.fail_after(timeout_s):
                while not await condition():  # noqa: ASYNC110
                    await trio.sleep(POLL_S)
        except trio.TooSlowError:
            raise AssertionError(f"timed out waiting for {what}:\n{self.log()[-3000:]}") from None

    async def logged(self, text: str) -> None:
        async def found() -> bool:
            return text in self.log()

        await self.wait_for(found, repr(text))

    async def held_stream(self, max_new_tokens: int) -> RawClient:
        """Open a stream whose reader reads nothing yet, with a small receive buffer."""
        client = RawClient("127.0.0.1", self.port)
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await client.post("/v1/stream", stream_body(max_new_tokens=max_new_tokens, ignore_eos=True))
        return client


@asynccontextmanager
async def cli_server(tmp_path: Path) -> AsyncIterator[Server]:
    """``python -m hypercorn -k trio tools.lab._asgi:app`` (the app with the lab's padding)
    on a free port, ready; killed at the end."""
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "hypercorn", "-k", "trio", "tools.lab._asgi:app", "--bind",
               "127.0.0.1:0", "--graceful-timeout", str(GRACEFUL_TIMEOUT_S)]
    with log_path.open("wb") as log_file:
        proc = await trio.lowlevel.open_process(
            command, cwd=REPO_ROOT, env={**os.environ, **SERVER_ENV, **LAB_ENV},
            stdin=subprocess.DEVNULL,
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        match = None
        with trio.fail_after(START_TIMEOUT_S):
            while match is None:
                assert proc.poll() is None, log_path.read_text(errors="replace")
                match = _RUNNING_ON.search(log_path.read_text(errors="replace"))
                await trio.sleep(POLL_S)
            server = Server(proc, log_path, int(match.group(1)), int(match.group(2)))
        async with server.client() as http:

            async def ready() -> bool:
                return (await http.get("/ready")).status_code == 200

            await server.wait_for(ready, "the model to load", START_TIMEOUT_S)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def open_held_streams(server: Server) -> tuple[RawClient, RawClient]:
    """A short and a long stream, both paused in the engine behind their full sockets."""
    short = await server.held_stream(SHORT_TOKENS)
    long = await server.held_stream(480)
    async with server.client() as http:

        async def both_paused() -> bool:
            return bool((await http.get("/stats")).json()["paused_streams"] == 2)

        await server.wait_for(both_paused, "both streams to pause")
        assert (await http.get("/stats")).json()["engine_requests"] == 2  # neither finished
    return short, long


async def read_all(client: RawClient) -> None:
    """The response's head and its whole body, to the chunked terminator."""
    await client.read_until(lambda events: bool(events))
    await client.read_to_end()


async def assert_drained_as_promised(server: Server, short: RawClient, long: RawClient) -> None:
    """The short stream finishes; the long one meets the deadline; exit 0, cache whole."""
    short.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # read it quickly
    await read_all(short)
    assert short.events[-1].event == "done", server.log()[-3000:]
    assert json.loads(short.events[-1].data)["usage"]["completion_tokens"] == SHORT_TOKENS

    await server.logged("drained in")
    await read_all(long)
    last = long.events[-1]
    assert (last.event, json.loads(last.data)) == (
        "error", {"error": {"type": "shutdown", "message": "the server is shutting down"}})

    short.sock.close()  # as a client does at the end of its response
    long.sock.close()
    with trio.fail_after(WAIT_TIMEOUT_S):
        assert await server.proc.wait() == 0, server.log()[-3000:]
    assert "cache whole: True, 64 of 64 blocks free" in server.log()


@dataclass
class IdleH2Connection:
    """An HTTP/2 connection in the clear (prior knowledge) with no stream on it."""

    stream: trio.SocketStream
    conn: h2.connection.H2Connection

    @classmethod
    async def open(cls, server: Server) -> IdleH2Connection:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        return cls(stream, conn)

    async def goaway(self) -> h2.events.ConnectionTerminated | None:
        """Read until the server closes the connection: its GOAWAY, if one came."""
        goaway = None
        with trio.fail_after(WAIT_TIMEOUT_S):
            while data := await self.stream.receive_some(65536):
                for event in self.conn.receive_data(data):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        goaway = event
        await self.stream.aclose()
        return goaway


async def assert_goaway_no_error(idle: IdleH2Connection) -> None:
    goaway = await idle.goaway()
    assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.NO_ERROR


async def test_sigterm_to_the_app_drains_refusing_new_requests_then_exits_0(
    tmp_path: Path,
) -> None:
    async with cli_server(tmp_path) as server:
        short, long = await open_held_streams(server)
        idle = await IdleH2Connection.open(server)

        os.kill(server.worker_pid, signal.SIGTERM)
        await assert_goaway_no_error(idle)  # while the streams drain
        async with server.client() as http:

            async def not_ready() -> bool:
                return (await http.get("/ready")).status_code != 200

            await server.wait_for(not_ready, "/ready to refuse")
            ready = await http.get("/ready")
            refused = await http.post("/v1/stream", json=stream_body(max_new_tokens=4))
            stats = (await http.get("/stats")).json()
        assert (stats["phase"], stats["hub_state"], stats["streams_open"]) == (
            "draining", "draining", 2)
        for answer in (ready, refused):
            assert answer.status_code == 503
            assert answer.headers["Retry-After"] == "1"
            assert answer.headers["Content-Type"] == "application/json"
            assert answer.json()["error"]["type"] == "shutdown"

        await assert_drained_as_promised(server, short, long)
        assert "draining (SIGTERM): 2 streams open" in server.log()


async def test_sigterm_to_hypercorns_main_process_drains_before_its_graceful_timeout(
    tmp_path: Path,
) -> None:
    async with cli_server(tmp_path) as server:
        short, long = await open_held_streams(server)
        idle = await IdleH2Connection.open(server)

        server.proc.send_signal(signal.SIGTERM)

        await assert_goaway_no_error(idle)
        await server.logged("draining (hypercorn is stopping): 2 streams open")
        await assert_drained_as_promised(server, short, long)

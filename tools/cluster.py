"""Replicas behind HAProxy with a Redis resume store, as real processes on loopback.

::

    async with open_cluster(replicas=2, log_dir=tmp) as cluster:
        run load against cluster.url ...
        await cluster.rolling_restart()       # each replica in turn: SIGTERM, wait, start

What ``tests/test_rolling_restart.py`` and ``python -m tools.lab replicas`` start: a
``redis-server`` (no persistence), N ``streamscope serve --bind 127.0.0.1:PORT``
processes sharing it through ``STREAMSCOPE_RESUME_STORE``, and ``haproxy`` running
``deploy/haproxy.cfg`` itself, with a second config file that adds only an admin socket,
through which ``server_states`` reads what HAProxy thinks of each replica (``show
stat``). Ports are free loopback ports picked once; a replica restarts on its own.

A rolling restart, as an operator does it (docs/deploy.md, Several replicas): for each replica,
SIGTERM (it drains: ``/ready`` and new requests get 503 with ``Retry-After``, open
streams finish), wait until it exited (0), start it again on the same port, wait until
its ``/ready`` says 200 and HAProxy counts it UP again, and only then go to the next;
so one replica at least is in HAProxy's pool all along.

Every wait here polls (a process or an HTTP answer has no event to wait on) with a
deadline; a replica that dies or is late raises ``ClusterError`` with its log's tail.
Every client has ``trust_env=False``. On the way out every process still running gets
SIGKILL, by its own pid (each runs in a session of its own).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

REPO_ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = REPO_ROOT / "deploy" / "haproxy.cfg"
POLL_S = 0.05
# deploy/haproxy.cfg's servers a to h: STREAMSCOPE_LB_REPLICA_A to _H.
REPLICA_LETTERS = "ABCDEFGH"
# Importing torch and loading tiny-gpt2 takes about 4 s on an idle 2-core machine;
# under load, and with another replica loading beside it, several times that.
START_TIMEOUT_S = 120.0
# A drain is bounded by STREAMSCOPE_SHUTDOWN_GRACE_S and hypercorn's graceful timeout
# (grace + 1 s); past this the replica is wedged.
EXIT_TIMEOUT_S = 60.0
# HAProxy checks /ready every second (deploy/haproxy.cfg: inter 1s rise 1 fall 2).
POOL_TIMEOUT_S = 30.0


class ClusterError(RuntimeError):
    """A process died, or was not ready in time; the message says which, with its log."""


def binary(name: str, package: str) -> str:
    """The path of ``name``, or ClusterError with the command that installs it."""
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if os.path.exists(p)), None)
    if path is None:
        raise ClusterError(f"{name} is missing: apt-get update && apt-get install -y {package}")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def serve_command(port: int) -> list[str]:
    """``streamscope serve --bind 127.0.0.1:PORT``, as ``python -m app.cli serve``: the
    console script's own ``main``, run from this checkout (``REPO_ROOT`` is the working
    directory) whatever checkout the script was installed from."""
    return [sys.executable, "-m", "app.cli", "serve", "--bind", f"127.0.0.1:{port}"]


@dataclass(frozen=True, slots=True)
class Restart:
    """One replica's restart, in seconds from the SIGTERM."""

    replica: str
    exit_code: int
    exited_s: float  # the old process exited (drained)
    ready_s: float  # the new one answered /ready 200
    in_pool_s: float  # HAProxy counted it UP again


@dataclass(slots=True)
class Replica:
    """One ``streamscope serve`` process on a fixed port; restartable."""

    name: str
    port: int
    env: dict[str, str]
    log_path: Path
    proc: trio.Process | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def start(self) -> None:
        """Start it and wait until ``/ready`` answers 200.

        Cancellation: the process is left running (``close`` kills it).
        """
        self.starts += 1
        with self.log_path.open("ab") as log_file:
            log_file.write(f"--- start {self.starts} ---\n".encode())
            log_file.flush()
            self.proc = await trio.lowlevel.open_process(
                serve_command(self.port), cwd=REPO_ROOT, env=self.env,
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True)
        await self.wait_ready()

    async def wait_ready(self) -> None:
        proc = self.proc
        assert proc is not None
        async with httpx.AsyncClient(base_url=self.url, timeout=5.0, trust_env=False) as client:
            with trio.move_on_after(START_TIMEOUT_S):
                while True:
                    if proc.poll() is not None:
                        raise ClusterError(f"replica {self.name} exited with "
                                           f"{proc.returncode}:\n{self.log()[-3000:]}")
                    with suppress(httpx.TransportError):
                        if (await client.get("/ready")).status_code == 200:
                            return
                    await trio.sleep(POLL_S)
        raise ClusterError(f"replica {self.name} not ready after {START_TIMEOUT_S:.0f} s:\n"
                           f"{self.log()[-3000:]}")

    def terminate(self) -> None:
        """SIGTERM: the drain (``streamscope serve`` handles it itself)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    async def wait_exit(self) -> int:
        """Wait until the process exited; its exit code."""
        assert self.proc is not None
        with trio.move_on_after(EXIT_TIMEOUT_S):
            return await self.proc.wait()
        raise ClusterError(f"replica {self.name} did not exit {EXIT_TIMEOUT_S:.0f} s after "
                           f"SIGTERM:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL to its process group (it is the group's leader), if still running."""
        if self.proc is not None and self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass(slots=True)
class Cluster:
    """What ``open_cluster`` started: ``url`` is HAProxy's."""

    url: str
    redis_url: str
    replicas: list[Replica]
    admin_socket: Path
    restarts: list[Restart] = field(default_factory=list)

    async def admin(self, command: str) -> str:
        """One command on HAProxy's admin socket (its runtime API); its answer."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sock:
            await sock.connect(str(self.admin_socket))
            await sock.send(command.encode() + b"\n")
            data = b""
            while chunk := await sock.recv(65536):
                data += chunk
        return data.decode()

    async def server_states(self) -> dict[str, str]:
        """HAProxy's status of each replica ("UP", "DOWN", "UP 1/2", "DRAIN", ...)."""
        states = {}
        for line in (await self.admin("show stat")).splitlines():
            fields = line.split(",")
            if len(fields) > 17 and fields[0] == "replicas" and fields[1] not in (
                    "BACKEND", "FRONTEND"):
                states[fields[1]] = fields[17]
        return states

    async def wait_in_pool(self, name: str, up: bool = True, state: str | None = None) -> None:
        """Until HAProxy counts replica ``name`` UP (or, ``up=False``, DOWN: not "UP 1/2",
        which is still UP after one failed check; or exactly ``state``)."""
        want = state or ("UP" if up else "DOWN")
        with trio.move_on_after(POOL_TIMEOUT_S):
            while (await self.server_states()).get(name) != want:  # noqa: ASYNC110
                await trio.sleep(POLL_S)  # HAProxy's state has no event to wait on
            return
        raise ClusterError(f"HAProxy did not count {name} {want} within "
                           f"{POOL_TIMEOUT_S:.0f} s: {await self.server_states()}")

    async def restart(self, replica: Replica, *, haproxy_drain: bool = True) -> Restart:
        """Out of HAProxy's pool first (``haproxy_drain``: ``set server ... state drain``,
        no new request goes there, open ones go on), then SIGTERM, wait for the exit,
        start again, wait until ready, back in the pool (``state ready``)."""
        began = time.perf_counter()
        if haproxy_drain:
            await self.admin(f"set server replicas/{replica.name} state drain")
            await self.wait_in_pool(replica.name, state="DRAIN")
        replica.terminate()
        code = await replica.wait_exit()
        exited = time.perf_counter() - began
        # Out of the pool before it listens again: a new process answers while its model
        # loads (503 not_ready), and HAProxy, counting it UP until `fall` checks failed,
        # would send it requests meanwhile.
        await self.wait_in_pool(replica.name, up=False)
        await replica.start()
        ready = time.perf_counter() - began
        if haproxy_drain:
            await self.admin(f"set server replicas/{replica.name} state ready")
        await self.wait_in_pool(replica.name)
        restart = Restart(replica.name, code, round(exited, 3), round(ready, 3),
                          round(time.perf_counter() - began, 3))
        self.restarts.append(restart)
        return restart

    async def rolling_restart(self, *, haproxy_drain: bool = True) -> list[Restart]:
        """Each replica in turn (see the module docstring)."""
        return [await self.restart(replica, haproxy_drain=haproxy_drain)
                for replica in self.replicas]


def _spawn_redis(port: int, log_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [binary("redis-server", "redis-server"), "--bind", "127.0.0.1", "--port", str(port),
         "--save", "", "--appendonly", "no"],
        stdout=(log_dir / "redis.log").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True)


def _spawn_haproxy(port: int, replicas: list[Replica], admin: Path, log_dir: Path,
                   config: Path = HAPROXY_CFG) -> subprocess.Popen[bytes]:
    """``config`` (deploy/haproxy.cfg as it is, by default), its servers ``a``, ``b``, ...
    the replicas in order (one replica: ``a`` and ``b``, which the config requires, both
    name it, so HAProxy balances over one process)."""
    extra = log_dir / "haproxy-admin.cfg"
    extra.write_text(f"global\n    stats socket {admin} mode 600 level admin\n")
    addresses = [f"127.0.0.1:{replica.port}" for replica in replicas]
    if len(addresses) == 1:
        addresses *= 2
    env = {**os.environ, "STREAMSCOPE_LB_BIND": f"127.0.0.1:{port}",
           **{f"STREAMSCOPE_LB_REPLICA_{letter}": address
              for letter, address in zip(REPLICA_LETTERS, addresses, strict=False)}}
    return subprocess.Popen(
        [binary("haproxy", "haproxy"), "-db", "-f", str(config), "-f", str(extra)],
        env=env, stdout=(log_dir / "haproxy.log").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True)


async def _wait_redis(url: str, process: subprocess.Popen[bytes]) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1.0)
    try:
        with trio.fail_after(START_TIMEOUT_S):
            while True:
                if process.poll() is not None:
                    raise ClusterError(f"redis-server exited with {process.returncode}")
                with suppress(redis.ConnectionError):
                    if client.ping():
                        return
                await trio.sleep(POLL_S)
    finally:
        client.close()


@asynccontextmanager
async def open_cluster(
    replicas: int = 2,
    *,
    log_dir: Path,
    settings: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    haproxy_cfg: Path = HAPROXY_CFG,
) -> AsyncIterator[Cluster]:
    """Redis, ``replicas`` (1 to 8) servers and HAProxy, all ready; killed on the way out.

    ``settings`` become ``STREAMSCOPE_<NAME>`` for every replica (besides the resume
    store); ``env`` adds other variables (``OMP_NUM_THREADS``); ``haproxy_cfg`` is the
    proxy's config (``tools.fleetbench`` compares the shipped one with a variant).
    """
    if not 1 <= replicas <= len(REPLICA_LETTERS):
        raise ValueError(f"deploy/haproxy.cfg names up to {len(REPLICA_LETTERS)} servers")
    log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (once, before anything runs)
    redis_port, lb_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    base_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                "STREAMSCOPE_RESUME_STORE": redis_url}
    # The replicas sign what they store with one secret (one for this cluster alone).
    base_env.setdefault("STREAMSCOPE_RESUME_SECRET", secrets.token_hex(32))
    for name, value in (settings or {}).items():
        base_env["STREAMSCOPE_" + name.upper()] = str(value)
    servers = [Replica(name, free_port(), dict(base_env), log_dir / f"replica-{name}.log")
               for name in REPLICA_LETTERS.lower()[:replicas]]
    admin = log_dir / "haproxy.sock"
    admin.unlink(missing_ok=True)  # a previous run's: HAProxy makes its own
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes.append(_spawn_redis(redis_port, log_dir))
        await _wait_redis(redis_url, processes[0])
        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(server.start)
        processes.append(_spawn_haproxy(lb_port, servers, admin, log_dir, haproxy_cfg))
        cluster = Cluster(f"http://127.0.0.1:{lb_port}", redis_url, servers, admin)
        with trio.fail_after(START_TIMEOUT_S):
            while not admin.exists():  # noqa: ASYNC110 (a file appears)
                await trio.sleep(POLL_S)
        for server in servers:
            await cluster.wait_in_pool(server.name)
        yield cluster
    finally:
        for server in servers:
            server.kill()
        for process in processes:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        with trio.CancelScope(shield=True):
            for server in servers:
                if server.proc is not None:
                    await server.proc.wait()
            for process in processes:
                await trio.to_thread.run_sync(process.wait)

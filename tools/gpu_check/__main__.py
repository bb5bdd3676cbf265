"""The checks that need a CUDA GPU, as one command of under 8 minutes (issue 44, item 4)::

    python -m tools.gpu_check /tmp/gpu-check        # writes its JSON into that folder

A machine with a GPU is lent to a session now and then, for minutes; this is what such a
session runs, prepared here and run there, one step after the other:

1. ``tests``: the suite's CUDA-marked tests (``pytest -m cuda``: tests/test_cuda.py),
   their outcome in ``tests.xml`` (JUnit) and counted in the summary;
2. ``bench_step``: ``python -m tools.bench step --device cuda`` at 1, 8, 32 and 128 rows
   (the engine's decode step against plain transformers, on the GPU), its JSON under
   ``bench_step/``;
3. ``sidebyside``: ``python -m tools.peers.sidebyside`` against ``transformers serve``
   on the same GPU (both started with ``STREAMSCOPE_DEVICE=cuda``: ours reads it, the
   peer's command takes its ``--device`` from it), at 1 and 32 streams, its JSON
   ``sidebyside.json``.

Each step runs as a subprocess with its own time limit (``LIMITS_S``, 7.5 minutes in all)
and its own outcome; ``gpu_check.json`` holds them all (exit status, seconds, the tail of
its output, the files it wrote), and the command exits non-zero if any step failed.

Without a CUDA device it does nothing but say so: one line on stderr naming what torch
sees, ``gpu_check.json`` with ``"cuda": false``, exit status 2 (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from tools.server import REPO_ROOT

NO_CUDA = 2
LIMITS_S = {"tests": 120, "bench_step": 150, "sidebyside": 180}  # under 8 minutes in all
BATCHES = (1, 8, 32, 128)
LEVELS = (1, 32)


def cuda_device() -> tuple[str | None, str]:
    """(the GPU's name, or None) and a line saying what torch sees."""
    import torch

    if not torch.cuda.is_available():
        return None, (f"no CUDA device: torch {torch.__version__} (CUDA build: "
                      f"{torch.version.cuda}) sees none; CUDA_VISIBLE_DEVICES="
                      f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    name = torch.cuda.get_device_name(0)
    return name, f"CUDA device 0: {name} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def steps(out: Path) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "tests": [python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                  f"--junitxml={out / 'tests.xml'}", "tests/"],
        "bench_step": [python, "-m", "tools.bench", "step", "--device", "cuda",
                       "--precision", "float32", "--batches", *map(str, BATCHES),
                       "--out", str(out / "bench_step")],
        "sidebyside": [python, "-m", "tools.peers.sidebyside", "--no-progress",
                       "--levels", *map(str, LEVELS), "--threads", "4",
                       "--json", str(out / "sidebyside.json")],
    }


def run_step(name: str, command: list[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "STREAMSCOPE_DEVICE": "cuda"}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=LIMITS_S[name], check=False)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status = None
        output = (f"{_text(exc.stdout)}{_text(exc.stderr)}\n"
                  f"timed out after {LIMITS_S[name]} s")
    result: dict[str, Any] = {"command": command, "exit_status": status,
                              "seconds": round(time.perf_counter() - started, 1),
                              "output_tail": str(output)[-3000:]}
    if name == "tests" and (out / "tests.xml").exists():
        suite = ElementTree.parse(out / "tests.xml").getroot().find("testsuite")
        if suite is not None:
            result["counts"] = {k: int(suite.get(k, 0))
                                for k in ("tests", "failures", "errors", "skipped")}
    return result


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder the JSON goes into")
    parser.add_argument("--only", nargs="+", choices=list(LIMITS_S), default=list(LIMITS_S))
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    device, line = cuda_device()
    report: dict[str, Any] = {"cuda": device is not None, "device": line, "steps": {}}
    if device is None:
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"gpu_check: {line}", file=sys.stderr)
        return NO_CUDA
    print(f"gpu_check: {line}", file=sys.stderr)
    for name in args.only:
        print(f"gpu_check: {name} (at most {LIMITS_S[name]} s)", file=sys.stderr)
        report["steps"][name] = run_step(name, steps(out)[name], out)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    failed = [n for n, r in report["steps"].items() if r["exit_status"] != 0]
    report["failed"] = failed
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"gpu_check: {'failed: ' + ', '.join(failed) if failed else 'all passed'}; "
          f"{out / 'gpu_check.json'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

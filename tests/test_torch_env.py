"""The variables torch reads once (engine/torch_env.py), as a fresh process sees them.

Each case runs in a process of its own: the suite's process imported torch long ago, and
what a variable does is decided when torch loads. What torch's OpenMP runtime read is
what it prints itself (libgomp's ``OMP_DISPLAY_ENV=verbose``), and the huge pages are
the kernel's own count (``/proc/self/smaps_rollup``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.torch_env import DEFAULTS, OMP_SPIN, huge_page_mode

ROOT = Path(__file__).parent.parent

_PROGRAM = """
import json, sys
if "--torch-first" in sys.argv:
    import torch
from engine.torch_env import huge_page_bytes, prepare
environment = prepare()
import torch
written = torch.ones(2**21)  # 8 MiB, written: its pages are committed
print(json.dumps({"applied": environment.applied, "kept": environment.kept,
                  "torch_was_loaded": environment.torch_was_loaded,
                  "huge_page_bytes": huge_page_bytes(), "said": environment.describe()}))
"""


def _run(*args: str, **env: str) -> tuple[dict[str, object], str]:
    clean = {k: v for k, v in os.environ.items() if k not in DEFAULTS}
    done = subprocess.run([sys.executable, "-c", _PROGRAM, *args], capture_output=True,
                          text=True, check=True, cwd=ROOT,
                          env={**clean, "OMP_DISPLAY_ENV": "verbose", **env})
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_fresh_process_gets_the_spin_and_the_huge_pages() -> None:
    result, displayed = _run()
    assert result["applied"] == DEFAULTS and result["kept"] == {}
    assert f"GOMP_SPINCOUNT = '{OMP_SPIN}'" in displayed  # what libgomp itself read
    mode = huge_page_mode()
    huge = result["huge_page_bytes"]
    # The kernel decides: with `never` no process gets huge pages; with madvise or always,
    # the 8 MiB tensor (2 MiB aligned, advised) is at least partly in them.
    if mode == "never":
        assert huge == 0
    else:
        assert isinstance(huge, int) and huge >= 2 * 2**20, (mode, huge)


def test_a_variable_the_environment_sets_is_kept() -> None:
    result, displayed = _run(GOMP_SPINCOUNT="300000", THP_MEM_ALLOC_ENABLE="0")
    assert result["applied"] == {}
    assert result["kept"] == {"GOMP_SPINCOUNT": "300000", "THP_MEM_ALLOC_ENABLE": "0"}
    assert "GOMP_SPINCOUNT = '300000'" in displayed
    assert result["huge_page_bytes"] == 0 or huge_page_mode() == "always"
    assert "(the environment's)" in str(result["said"])


def test_after_torch_is_imported_nothing_is_set() -> None:
    result, displayed = _run("--torch-first")
    assert result["torch_was_loaded"] is True and result["applied"] == {}
    assert f"GOMP_SPINCOUNT = '{OMP_SPIN}'" not in displayed
    assert "torch was imported before" in str(result["said"])

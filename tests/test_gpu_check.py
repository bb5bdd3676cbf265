"""``python -m tools.gpu_check`` where there is no GPU: one clear line, a JSON that says
so, exit status 2, and none of its steps run. (Its steps themselves need a GPU: they run
when a session has one.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.gpu_check.__main__ import NO_CUDA
from tools.server import REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here: the check would run")
def test_without_a_cuda_device_it_says_so_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", str(out)], cwd=REPO_ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=120, check=False)

    assert done.returncode == NO_CUDA
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device: torch ")
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["cuda"] is False and report["steps"] == {}
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json"]

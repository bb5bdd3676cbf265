"""``python -m tools.tracebench`` in its quick form (the tiny model, a few streams): it
writes its JSON with both kinds of run, the *on* server exported every request's spans
to the receiver, and the direct cost was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.server import REPO_ROOT

COMMAND_TIMEOUT_S = 300  # a safety net: two server starts and four short runs


def test_tracebench_measures_runs_with_tracing_on_and_off_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tools.tracebench", "--model", "tiny-gpt2", "--streams", "4",
         "--max-new-tokens", "8", "--rounds", "2", "--threads", "1", "--json", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["kind"] for r in data["runs"]] == ["off", "on", "on", "off"]
    assert data["errors"] == 0
    assert all(r["tokens"] == 4 * 8 for r in data["runs"])
    assert data["spans"] == data["spans_expected"] == (2 + 4 + 4) * 4  # warm-up, two runs
    assert data["ratio"] > 0 and data["within_goal"] == (data["ratio"] >= data["goal"])
    assert data["off_server_cpu_ms_per_token"] > 0 and data["cpu_ratio"] > 0
    cost = data["record_cost"]
    assert cost["spans_received"] == cost["requests"] * 4
    assert cost["traced_cpu_us_per_request"] > cost["plain_cpu_us_per_request"] > 0

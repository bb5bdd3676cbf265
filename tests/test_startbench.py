"""``python -m tools.startbench --quick``: both ways of starting ours, the tiny model, once.

Each system is started in a subprocess as a user would start it, timed to ``/ready`` and
its first token, its own phases read from ``/stats``; the JSON must hold the figures the
results page reads (the full run adds the peer and the embedded model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.server import REPO_ROOT
from tools.startbench import tree_rss_mb

COMMAND_TIMEOUT_S = 240  # a safety net: two starts of the tiny model, 10-30 s each


def test_startbench_quick_times_both_starts_and_their_phases(tmp_path: Path) -> None:
    out = tmp_path / "start.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tools.startbench", "--quick", "--threads", "1",
         "--json", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    data = json.loads(out.read_text())
    assert data["meta"]["systems"] == ["serve", "hypercorn"]
    assert len(data["meta"]["loadavg_before"]) == 3
    assert data["interpreter_rss_mb"] > 0 and data["weights_mb"] is None  # tiny: no file
    for system in ("serve", "hypercorn"):
        figures = data["summary"][system]
        ready = figures["ready_s"]["median"]
        assert 0 < figures["listening_s"]["median"] <= ready
        assert ready < figures["first_token_from_spawn_s"]["median"]
        phases = figures["start_phases_median_s"]
        assert {"import_torch", "import_transformers", "cache", "gc_freeze",
                "process_until_load"} <= set(phases)
        assert "calibration" not in phases  # no step-time target
        assert figures["rss_ready_mb_median"] > 0
        assert figures["rss_after_streams_mb"]["largest"] > 0
        assert figures["streams"]["streams_ok"] == 4 and figures["streams"]["errors"] == 0
        assert data["targets"][system]["ready_s"] == ready
    run = data["runs"][0]
    assert run["first_request"]["ok"] and run["first_request"]["tokens"] == 8
    assert run["blocks_total"] == 256


def test_tree_rss_counts_this_process() -> None:
    rss = tree_rss_mb(os.getpid())
    assert rss["total"] >= rss["largest"] > 0
    assert rss["largest_anon"] + rss["largest_file"] <= rss["largest"] + 1

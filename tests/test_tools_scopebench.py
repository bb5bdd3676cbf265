"""``python -m tools.scopebench`` in its quick form (the tiny model, a few streams): it
writes its JSON with both kinds of run, and the watched ones did read frames."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.server import REPO_ROOT

COMMAND_TIMEOUT_S = 300  # a safety net: a server start and four short runs


def test_scopebench_measures_watched_and_unwatched_runs_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "scope.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tools.scopebench", "--model", "tiny-gpt2", "--streams", "4",
         "--max-new-tokens", "8", "--rounds", "2", "--threads", "1", "--json", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["kind"] for r in data["runs"]] == ["none", "watched", "watched", "none"]
    assert data["errors"] == 0
    assert all(r["tokens"] == 4 * 8 for r in data["runs"])
    watched = [r for r in data["runs"] if r["kind"] == "watched"]
    assert all(r["frames"] > 0 and r["snapshots"] >= 1 for r in watched)
    assert all("frames" not in r for r in data["runs"] if r["kind"] == "none")
    assert data["ratio"] > 0 and data["within_goal"] == (data["ratio"] >= data["goal"])
    assert data["none_server_cpu_ms_per_token"] > 0 and data["cpu_ratio"] > 0


def test_watchers_cost_times_both_ways_of_encoding_for_every_watcher() -> None:
    from tools.scopebench import watchers_cost

    data = watchers_cost(streams=2, watchers=3, frames=5)

    assert (data["streams"], data["watchers"], data["frames"]) == (2, 3, 5)
    assert data["unshared_cpu_us_per_frame"] > 0 and data["shared_cpu_us_per_frame"] > 0
    assert abs(data["shared_cpu_us_per_watcher"] - data["shared_cpu_us_per_frame"] / 3) < 0.1


def test_scopewatchers_times_requests_for_each_count_of_watchers(tmp_path: Path) -> None:
    out = tmp_path / "watchers.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tools.scopewatchers", "--watchers", "0,3", "--runs", "2",
         "--tokens", "4", "--json", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [c["watchers"] for c in data["counts"]] == [0, 3]
    assert all(len(c["seconds"]) == 2 and c["median_s"] > 0 for c in data["counts"])
    assert all(c["server_cpu_ms_per_token"] > 0 for c in data["counts"])

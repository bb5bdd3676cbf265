"""``python -m tools.lab hostile --quick`` runs and reports its figures (issue 43).

The figures themselves (the probe's gaps, the server's memory) depend on the machine:
the test checks what does not: every hostile constraint was refused before its stream
with ``invalid_constraint``, nothing answered 5xx, and the summary has its keys. The
full run on the embedded model is the measurement (``docs/security.md``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.server import REPO_ROOT

COMMAND_TIMEOUT_S = 300  # a safety net; it takes some 15 s


def test_the_hostile_experiment_refuses_every_nested_count_and_answers_no_5xx(
        tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    subprocess.run([sys.executable, "-m", "tools.lab", "hostile", "--quick", "--no-progress",
                    "--out", str(tmp_path)], cwd=REPO_ROOT, env=env, check=True,
                   timeout=COMMAND_TIMEOUT_S, capture_output=True)
    summary = json.loads((tmp_path / "hostile.json").read_text())["summary"]

    assert summary["hostile_requests"] > 0
    assert summary["hostile_statuses"] == {"422": summary["hostile_requests"]}
    assert summary["five_xx"] == summary["probe_five_xx"] == 0
    assert '"invalid_constraint"' in summary["hostile_refusal"]
    assert "costs too much" in summary["hostile_refusal"]
    for key in ("gap_p50_ms_solo", "gap_p90_ms_solo", "gap_p50_ms_hostile",
                "gap_p90_ms_hostile", "gap_p90_ratio", "cached_json_ms_solo",
                "cached_json_ms_hostile", "rss_growth_mb", "hostile_per_s"):
        assert isinstance(summary[key], int | float), key

"""``python -m tools.peers.rounds``: its seconds-long form over HTTP, and its arithmetic.

The command runs in a subprocess against our server and this checkout started as
"another" tree (``--before``), tiny GPT-2, two rounds; the spread of one-stream ratios
against ``llama-server`` is checked on figures written out here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.peers.rounds import spread
from tools.server import REPO_ROOT

COMMAND_TIMEOUT_S = 180  # a safety net: four tiny servers start and stop in 20-60 s


def test_rounds_alternate_the_systems_and_give_each_round_s_ratio(tmp_path: Path) -> None:
    out = tmp_path / "rounds.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tools.peers.rounds", "--model", "tiny-gpt2", "--rounds", "2",
         "--requests", "2", "--max-new-tokens", "4", "--before", str(REPO_ROOT),
         "--json", str(out), "--no-progress"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    data = json.loads(out.read_text())
    assert data["meta"]["rounds"] == 2 and data["level"] == 1
    assert [list(r) for r in data["rounds"]] == [["streamscope-before", "streamscope"]] * 2
    for figures in (f for r in data["rounds"] for f in r.values()):
        assert figures["errors"] == 0 and figures["tokens_per_stream"] == [4]
        assert "stream_records" not in figures
    tokens = data["ratios"]["streamscope-before"]["tokens_per_s_counted"]
    assert len(tokens["rounds"]) == 2 and all(r > 0 for r in tokens["rounds"])
    assert tokens["least"] <= tokens["median"] <= tokens["largest"]
    assert "llama_one_stream" not in data  # no llama-server in the rounds


def test_the_one_stream_target_is_counted_per_round_and_on_the_median() -> None:
    def figures(ours: float, llama: float) -> dict[str, dict[str, float]]:
        return {"streamscope": {"tokens_per_s_counted": ours, "ttft_p99_ms": 80.0},
                "llama-server": {"tokens_per_s_counted": llama, "ttft_p99_ms": 130.0}}

    rounds = [figures(80, 100), figures(76, 100), figures(90, 100)]
    result = spread(rounds, ["streamscope", "llama-server"], level=1)
    tokens = result["ratios"]["llama-server"]["tokens_per_s_counted"]
    assert tokens == {"rounds": [0.8, 0.76, 0.9], "median": 0.8, "least": 0.76,
                      "largest": 0.9}
    assert result["llama_one_stream"] == {"target": 0.8, "rounds_met": 2, "rounds": 3,
                                          "median_met": True}
    assert result["ratios"]["llama-server"]["gap_p50_ms"]["median"] is None  # not given
    assert "llama_one_stream" not in spread(rounds, ["streamscope", "llama-server"], level=8)

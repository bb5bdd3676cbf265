"""``python -m tools.servicebench --quick``, end to end, and its client's counting.

The quick form runs the whole command (both engines, ours and the Starlette peer, levels
1 and 8, 32 tokens) in a subprocess, as a user would, and must write every figure for
every level, engine and server, with every stream complete. The client's token count is
checked on its own against bytes cut at every boundary, since every figure rests on it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tools.server import REPO_ROOT
from tools.servicebench import ENGINES, QUICK_LEVELS, QUICK_TOKENS, ROW_FIELDS
from tools.servicebench_client import PATTERN, Stream
from tools.servicebench_servers import OURS, PEER

COMMAND_TIMEOUT_S = 150  # a safety net: the quick form takes 20-40 s on this machine


def test_client_counts_tokens_across_every_read_boundary() -> None:
    body = b"".join(b"event: token\nid: %d\ndata: {}\n\n" % i for i in range(5))
    body = b"HTTP/1.1 200 OK\r\n\r\nevent: start\ndata: {}\n\n" + body + b"event: done\n\n"
    for cut in range(1, len(body)):
        stream = Stream(b"")
        stream.feed(body[:cut], 1.0)
        stream.feed(body[cut:], 2.0)
        assert len(stream.arrivals) == 5, cut
        assert stream.status() == 200
    byte_by_byte = Stream(b"")
    for i in range(len(body)):
        byte_by_byte.feed(body[i:i + 1], float(i))
    assert len(byte_by_byte.arrivals) == body.count(PATTERN) == 5


def test_servicebench_quick_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "servicebench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tools.servicebench", "--quick", "--json", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| engine | N |" in done.stdout

    data = json.loads(out.read_text())
    assert data["meta"]["levels"] == list(QUICK_LEVELS)
    assert data["meta"]["tokens"] == QUICK_TOKENS
    assert set(data["engines"]) == set(ENGINES)
    for kind, result in data["engines"].items():
        assert set(result["levels"]) == {str(n) for n in QUICK_LEVELS}
        for n, level in result["levels"].items():
            ceiling = level["ceiling"]
            assert ceiling["tokens_per_s"] > 0 and ceiling["engine_alone"]["tokens_per_s"] > 0
            assert level["ours_over_peer"] > 0
            assert set(level["systems"]) == {OURS, PEER}
            for name, row in level["systems"].items():
                where = f"{kind} N={n} {name}"
                assert set(ROW_FIELDS) <= set(row), (where, set(ROW_FIELDS) - set(row))
                assert row["tokens"] == row["tokens_expected"] == int(n) * QUICK_TOKENS, where
                assert row["streams_complete"] == int(n) and row["statuses"] == ["200"], where
                assert row["errors"] == [], where
                # No upper bound: the ceiling is measured in the same noisy run, and a
                # loaded machine let the peer beat a disturbed one by 1.55x (a 6th suite
                # run under stress-ng); the figure's existence and sign are what is tested.
                assert 0 < row["share_of_ceiling"] < math.inf, where
                for share in ("step_wait_share", "step_idle_share"):
                    assert 0 <= row[share] <= 1, (where, share)
                assert 0 < row["step_running_share"] <= 1.5, where
                assert row["loop_cpu_us_per_token"] > 0 and row["step_cpu_us_per_token"] > 0
                assert row["bytes_per_token"] > len(PATTERN) and row["rss_mib"] > 0, where
                assert 0 <= row["gap_p50_ms"] <= row["gap_p99_ms"] <= row["gap_max_ms"], where
                assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] <= row["ttft_max_ms"], where

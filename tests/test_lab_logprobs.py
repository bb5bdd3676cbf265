"""The logprobs experiment works, quick: ``python -m tools.lab logprobs --quick`` in a
subprocess (its own servers, tiny GPT-2, one torch thread) writes its JSON and plot with
sane figures; and ``item_bytes`` counts what one queued event is made of.

The mechanics, not the timings: the quick streams are smaller than the socket buffers,
so no reader meets backpressure there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine import TokenEvent, TokenLogprobs
from tools.lab.logprobs import item_bytes
from tools.lab.naive import LAB_POLICIES
from tools.server import REPO_ROOT

COMMAND_TIMEOUT_S = 240  # a safety net; it takes under a minute


def test_logprobs_quick_measures_bytes_and_every_policy(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tools.lab", "logprobs", "--quick", "--no-progress",
         "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    document = json.loads((tmp_path / "logprobs.json").read_text())
    summary = document["summary"]
    assert next(iter(document)) == "summary"
    assert (tmp_path / "logprobs.png").stat().st_size > 0
    sizes = summary["bytes_per_token"]
    assert 30 < sizes["native_none"] < 300
    assert sizes["native_top20"] > 10 * sizes["native_none"]
    assert sizes["completions_logprobs5"] > sizes["native_none"]
    assert sizes["chat_top20"] is None  # the tiny model has no chat template
    assert summary["item_bytes"]["objects"] > 0 and summary["item_bytes"]["eager"] > 0
    assert set(summary["healthy_slowdown"]) == set(LAB_POLICIES)
    for received in summary["slow_received"].values():
        assert sum(received.values()) == 4  # four slow readers (k=4) per policy
        assert set(received) <= {"done", "error:slow_client"}
    assert all(v is not None and v >= 0 for v in summary["peak_queued"].values())
    assert summary["errors"] == 0


def test_item_bytes_counts_each_object_once_but_the_shared_ones() -> None:
    shared_text = "shared"
    top = tuple((1000 + i, shared_text, -1.0 - i) for i in range(3))
    event = TokenEvent("r" * 32, 0, 5000, "delta", TokenLogprobs(shared_text, -0.5, top))

    counted = item_bytes(event, shared={id(shared_text)})

    alone = item_bytes(TokenEvent("r" * 32, 0, 5000, "delta"), shared=set())
    assert counted > alone > 0
    assert item_bytes(event, shared=set()) == counted + sys.getsizeof(shared_text)

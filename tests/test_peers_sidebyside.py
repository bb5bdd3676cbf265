"""``python -m tools.peers.sidebyside`` and the peer launcher, in forms that take seconds.

The side-by-side command runs in a subprocess against our server alone (``--no-peer``,
tiny GPT-2) and must write the JSON the docs read. The peer launcher starts the real
``transformers serve --continuous-batching`` on a folder holding the tiny Llama (the
``peer`` extra is part of the test extra, so a missing fastapi fails here, it does not
skip) and one short run goes through it with EOS off, as the full run does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import trio

from engine.model import tiny_llama, tiny_tokenizer
from tools.load_runner import run_load
from tools.peers.sidebyside import compare, targets
from tools.peers.transformers_serve import open_peer, peer_command
from tools.records import StreamRequest
from tools.server import REPO_ROOT
from tools.wire import PROTOCOLS

COMMAND_TIMEOUT_S = 180  # a safety net: the command takes 20-40 s on a busy machine


def test_sidebyside_quick_writes_figures_and_targets(tmp_path: Path) -> None:
    """Ours alone, beside "another" checkout (this one, started from its path as another
    tree would be)."""
    out, png = tmp_path / "sbs.json", tmp_path / "sbs.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tools.peers.sidebyside", "--model", "tiny-gpt2", "--no-peer",
         "--levels", "1", "4", "--requests", "4", "--baseline-requests", "2",
         "--max-new-tokens", "4", "--json", str(out), "--plot", str(png), "--no-progress",
         "--before", str(REPO_ROOT)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    data = json.loads(out.read_text())
    assert data["meta"]["threads"] == 1 and data["meta"]["levels"] == [1, 4]
    assert data["meta"]["order"] == ["streamscope-before", "streamscope"]
    assert data["meta"]["before_tree"] == str(REPO_ROOT)
    assert set(data["ratios_ours_over_before"]) == {"1", "4"}
    before = data["systems"]["streamscope-before"]["levels"]
    assert all(f["errors"] == 0 and f["tokens_per_stream"] == [4] for f in before.values())
    assert data["before_targets"]["level"] == 4 and data["before_targets"]["of_reference"] > 0
    assert len(data["systems"]["streamscope"]["loadavg_start_end"]) == 2
    ceiling = data["ceiling"]
    assert ceiling["batch"] == 4 and ceiling["step_ms"] > 0 and ceiling["packed_prefill_ms"] > 0
    assert ceiling["tokens_per_s"] == round(4 * 1000 / ceiling["step_ms"], 2)
    levels = data["systems"]["streamscope"]["levels"]
    assert set(levels) == {"1", "4"}
    assert levels["1"]["streams"] == 2 and levels["4"]["streams"] == 4
    for figures in levels.values():
        assert figures["errors"] == 0 and figures["tokens_per_stream"] == [4]
        # usage asked for (stream_options) and sent: it counts the 4 tokens each stream
        # sent as chunks, and the counted rate is over the rounded makespan
        assert figures["usage_completion_tokens"] == [4]
        assert figures["tokens_per_s_counted"] == round(
            4 * figures["streams_ok"] / figures["makespan_s"], 2)
        records = figures["stream_records"]
        assert [len(s["token_ms"]) for s in records] == [4] * figures["streams_ok"]
        assert figures["finish_reasons"] == ["length"]  # EOS off: every stream runs out
        assert 0 <= figures["gap_p50_ms"] <= figures["gap_p99_ms"] <= figures["gap_max_ms"]
    assert data["ratios_ours_over_peer"] is None
    assert set(data["targets"]) == {"level", "of_ceiling", "of_ceiling_met",
                                    "ttft_p99_over_prefill_plus_step", "ttft_p99_met",
                                    "reference_tokens_per_s", "of_reference"}
    assert png.stat().st_size > 0


def test_ratios_and_targets_from_figures() -> None:
    ours = {"32": {"tokens_per_s_counted": 200.0, "ttft_p50_ms": 500.0, "ttft_p99_ms": 1300.0,
                   "gap_p50_ms": 100.0, "gap_p99_ms": 300.0, "gap_max_ms": 400.0}}
    peer = {"32": {"tokens_per_s_counted": 100.0, "ttft_p50_ms": 1000.0, "ttft_p99_ms": 2600.0,
                   "gap_p50_ms": 200.0, "gap_p99_ms": 600.0, "gap_max_ms": 800.0}}
    ceiling = {"tokens_per_s": 250.0, "step_ms": 128.0, "packed_prefill_ms": 872.0}

    assert compare(ours, peer) == {"32": dict.fromkeys(
        ("tokens_per_s_counted",), 2.0) | dict.fromkeys(
        ("ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms", "gap_max_ms"), 0.5)}
    assert targets(ours, peer, ceiling, 32) == {
        "level": 32, "of_ceiling": 0.8, "of_ceiling_met": True,
        "ttft_p99_over_prefill_plus_step": 1.3, "ttft_p99_met": True,
        "over_peer": 2.0, "over_peer_met": True}
    # 32 x 64 tokens in 872 ms of prefill plus 63 steps of 128 ms: 229.2 tokens/s
    with_reference = targets(ours, peer, ceiling, 32, max_new_tokens=64)
    assert {k: with_reference[k] for k in ("reference_tokens_per_s", "of_reference",
                                          "peer_of_reference")} == {
        "reference_tokens_per_s": 229.19, "of_reference": 0.873, "peer_of_reference": 0.436}


def test_peer_wire_turns_eos_off_with_its_own_field() -> None:
    body = PROTOCOLS["transformers"].body(StreamRequest("Hi", 8, ignore_eos=True), None)
    assert "ignore_eos" not in body  # the peer answers an unknown field with 422
    assert json.loads(body["generation_config"]) == {"eos_token_id": -1, "do_sample": False}
    assert (body["max_tokens"], body["temperature"], body["stream"]) == (8, 0, True)
    assert "generation_config" not in PROTOCOLS["transformers"].body(
        StreamRequest("Hi", 8), None)


def test_peer_launcher_serves_a_local_folder_offline(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    command = peer_command(folder)
    assert command[1:3] == ["serve", str(folder)] and "--continuous-batching" in command
    assert "--cb-num-blocks" in command  # else its first request sizes a cache from RAM
    assert command[-2:] == ["--port", "0"]

    async def go() -> tuple[str, list[int | None], list[str]]:
        async with open_peer(folder, env={"OMP_NUM_THREADS": "1"}) as url:
            result = await run_load(url, ["Every stream has an owner"], clients=2,
                                    max_new_tokens=6, ignore_eos=True,
                                    protocol="transformers", progress=False)
        return url, [(r.usage or {}).get("completion_tokens") for r in result.records], [
            str(r.finish_reason or r.error) for r in result.records]

    url, tokens, finishes = trio.run(go)
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    # EOS off: all 6 made (the peer's own count: a chunk may hold less or more than a
    # token's text, and the tiny tokenizer's random bytes are often held back)
    assert tokens == [6, 6] and finishes == ["length", "length"]

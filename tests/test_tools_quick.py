"""The measurement tools work: ``tools.load`` and ``tools.lab`` in their quick forms.

One real server for the module (``tools.server.serve``: hypercorn in a subprocess, the
tiny GPT-2 on the CPU with one torch thread); each command runs in its own subprocess
against it with ``--url`` and must write its JSON with sane figures. The parsing of the
OpenAI-compatible protocol and the SSE checks are tested in-process on scripted input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streams import ServerSentEvent
from tools.lab.sse import check_stream
from tools.records import StreamRecord, StreamRequest
from tools.server import REPO_ROOT, serve
from tools.wire import OpenAIWire

COMMAND_TIMEOUT_S = 120  # a safety net; each command takes seconds


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    settings = {"model": "tiny-gpt2", "device": "cpu", "cache_blocks": 1024}
    with serve(settings, env={"OMP_NUM_THREADS": "1"}) as url:
        yield url


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", *args, "--no-progress"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def read_json(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    assert next(iter(document)) == "summary"
    return document


def test_load_measures_concurrent_streams(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    run_tool(
        "tools.load",
        "--url",
        server_url,
        "--clients",
        "4",
        "--requests",
        "6",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
        str(out),
    )

    document = read_json(out)
    summary = document["summary"]
    assert (summary["streams"], summary["streams_ok"], summary["errors"]) == (6, 6, 0)
    assert summary["tokens"] == 6 * 8
    assert summary["makespan_s"] > 0 and summary["tokens_per_s"] > 0
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    assert 0 <= summary["gap_p50_ms"] <= summary["gap_p99_ms"]
    assert 30 < summary["bytes_per_token"] < 300
    streams = document["streams"]
    assert [s["client"] for s in streams] == [0, 1, 2, 3, 0, 1]
    assert all(len(s["token_ids"]) == 8 and s["finish_reason"] == "length" for s in streams)


def test_lab_overlap_quick(server_url: str, tmp_path: Path) -> None:
    done = run_tool("tools.lab", "overlap", "--quick", "--url", server_url, "--out", str(tmp_path))

    summary = read_json(tmp_path / "overlap.json")["summary"]
    assert (tmp_path / "overlap.png").stat().st_size > 0
    # Greedy float32 on the paged cache: every concurrent stream equals its solo run.
    assert summary["compared_streams"] == 1 + 2 + 4 + 8 + 16 + 32
    assert summary["identical_streams"] == summary["compared_streams"]
    assert summary["errors"] == 0
    assert set(summary["tokens_per_s"]) == {"1", "2", "4", "8", "16", "32"}
    assert all(v > 0 for v in summary["tokens_per_s"].values())
    assert summary["speedup_32"] > 0
    assert 0 < summary["ttft_p50_32"] <= summary["ttft_p99_32"]
    assert summary["gap_p99_32"] > 0
    assert summary["joiner_ratio_8"] > 0 and summary["joiner_ratio_24"] > 0
    assert "speedup_32" in done.stdout


def test_lab_sse_quick(server_url: str, tmp_path: Path) -> None:
    run_tool("tools.lab", "sse", "--quick", "--url", server_url, "--out", str(tmp_path))

    summary = read_json(tmp_path / "sse.json")["summary"]
    assert summary["streams_checked"] == summary["streams_ok"] == 6
    assert summary["round_trip_ok"] is True
    assert 30 < summary["bytes_per_token"] < 300


# -- in-process: the parts a live server cannot make fail -----------------------------------


def openai_events(*chunks: dict[str, Any] | str) -> list[ServerSentEvent]:
    return [ServerSentEvent(data=c if isinstance(c, str) else json.dumps(c)) for c in chunks]


def test_openai_chunks_count_as_tokens_except_the_closing_one() -> None:
    wire, record = OpenAIWire(), StreamRecord(0, 0, StreamRequest("p", 3))
    events = openai_events(
        {"choices": [{"text": "Hel", "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": None}]},  # a token held back
        {"choices": [{"text": "lo", "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 3}},
        "[DONE]",
    )

    added = [wire.on_event(record, event, now=float(i)) for i, event in enumerate(events)]

    assert added == [1, 1, 1, 0, 0]
    assert (record.texts, record.finish_reason, record.ok) == (["Hel", "", "lo"], "length", True)
    assert record.token_times == [0.0, 1.0, 2.0]
    assert (record.usage, record.finished_at) == ({"completion_tokens": 3}, 4.0)


def test_openai_error_chunk_is_recorded() -> None:
    wire, record = OpenAIWire(), StreamRecord(0, 0, StreamRequest("p", 3))

    wire.on_event(record, openai_events({"error": {"message": "overloaded"}})[0], now=1.0)

    assert record.error is not None and "overloaded" in record.error
    assert not record.ok


def sse_record(body: bytes, **headers: str) -> StreamRecord:
    record = StreamRecord(
        0,
        0,
        StreamRequest("p", 2),
        status=200,
        raw=bytearray(body),
        headers={"content-type": "text/event-stream", **headers},
    )
    record.token_ids = [5, 6]
    return record


GOOD_BODY = (
    b'event: start\nid: 1\ndata: {"id":"r1","prompt_tokens":3}\n\n'
    b'event: token\nid: 2\ndata: {"index":0,"id":5,"text":"a"}\n\n'
    b'event: token\nid: 3\ndata: {"index":1,"id":6,"text":""}\n\n'
    b'event: done\nid: 4\ndata: {"finish_reason":"length",'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"cached_tokens":1}}\n\n'
)
GOOD_ANSWER = {
    "tokens": [5, 6],
    "text": "a",
    "finish_reason": "length",
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1},
}


def test_sse_checks_pass_a_well_formed_stream() -> None:
    result = check_stream(sse_record(GOOD_BODY, **{"x-request-id": "r1"}), GOOD_ANSWER)

    assert result["ok"], result["checks"]
    assert (result["events"], result["last_event_id"], result["empty_deltas"]) == (4, "4", 1)
    assert result["bytes_identical"]


@pytest.mark.parametrize(
    ("body", "headers", "answer", "failed"),
    [
        (GOOD_BODY, {"x-request-id": "other"}, GOOD_ANSWER, {"request_id"}),
        (GOOD_BODY.replace(b"id: 3", b"id: 7"), {"x-request-id": "r1"}, GOOD_ANSWER, {"ids"}),
        (GOOD_BODY + b"event: token\ndata: {}", {"x-request-id": "r1"}, GOOD_ANSWER, {"complete"}),
        (
            GOOD_BODY,
            {"x-request-id": "r1"},
            {**GOOD_ANSWER, "tokens": [5, 7]},
            {"matches_generate"},
        ),
        (  # more tokens found cached than the prompt has
            GOOD_BODY.replace(b'"cached_tokens":1', b'"cached_tokens":4'),
            {"x-request-id": "r1"},
            {**GOOD_ANSWER, "usage": {**GOOD_ANSWER["usage"], "cached_tokens": 4}},
            {"usage"},
        ),
    ],
)
def test_sse_checks_catch_each_fault(
    body: bytes, headers: dict[str, str], answer: dict[str, Any], failed: set[str]
) -> None:
    result = check_stream(sse_record(body, **headers), answer)

    assert {name for name, ok in result["checks"].items() if not ok} == failed


def test_each_lab_module_registers_its_namesake_and_a_run_imports_only_it() -> None:
    """``python -m tools.lab NAME`` imports only module ``NAME``: it must register ``NAME``,
    and a run must not pay for torch, which only some experiments import."""
    script = (
        "import sys\n"
        "import tools.lab.__main__ as lab\n"
        "from tools.lab.common import REGISTRY\n"
        "lab.load_experiments(['slowclient', '--quick'])\n"
        "print(sorted(REGISTRY), 'torch' in sys.modules)\n"
        "lab.load_experiments(['--list'])\n"
        "print(len(REGISTRY) > 10 and set(REGISTRY) <= set(lab.experiment_modules()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["['slowclient'] False", "True"]

"""``tools.peers.sidebyside_chart``: runs of the side-by-side drawn in one chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.peers.sidebyside_chart import chart, series


def _run(threads: int, precision: str, ours: list[float], llama: list[float]) -> dict[str, Any]:
    def levels(values: list[float]) -> dict[str, Any]:
        return {"levels": {str(n): {"tokens_per_s_counted": v}
                           for n, v in zip((32, 1, 8), values, strict=True)}}
    return {"meta": {"threads": threads, "model": "smollm2", "max_new_tokens": 64,
                     "streamscope_env": {"STREAMSCOPE_DTYPE": precision}},
            "systems": {"streamscope": levels(ours), "llama-server": levels(llama)}}


def test_series_are_in_level_order_and_every_thread_count_gets_a_panel(tmp_path: Path) -> None:
    runs = [_run(1, "bfloat16", [400, 20, 150], [100, 50, 90]),
            _run(2, "int8", [290, 44, 150], [180, 90, 160])]
    assert series(runs[0], "streamscope") == ([1, 8, 32], [20.0, 150.0, 400.0])

    out = tmp_path / "chart.png"
    chart(runs, out, names=None)

    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""``tools.servicebench``'s report: the markdown table it prints and the PNG it draws,
both from the JSON it writes.

Why apart from the command: the rendering reads only that JSON, never a server, so it
can change (or redraw an earlier run's file) without touching the measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tools.figures import save_figure
from tools.servicebench_servers import OURS, PEER

TABLE = (  # (header, figure of a level entry)
    ("engine", lambda k, n, lv: k), ("N", lambda k, n, lv: n),
    ("tokens/s", lambda k, n, lv: lv["systems"][OURS]["tokens_per_s"]),
    ("ceiling", lambda k, n, lv: lv["ceiling"]["tokens_per_s"]),
    ("share", lambda k, n, lv: lv["systems"][OURS]["share_of_ceiling"]),
    ("loop µs/tok", lambda k, n, lv: lv["systems"][OURS]["loop_cpu_us_per_token"]),
    ("step µs/tok", lambda k, n, lv: lv["systems"][OURS]["step_cpu_us_per_token"]),
    ("step wait", lambda k, n, lv: lv["systems"][OURS]["step_wait_share"]),
    ("step idle", lambda k, n, lv: lv["systems"][OURS]["step_idle_share"]),
    ("step running", lambda k, n, lv: lv["systems"][OURS]["step_running_share"]),
    ("TTFT p50/p99 ms", lambda k, n, lv: _pair(lv["systems"][OURS], "ttft", ("p50", "p99"))),
    ("gap p50/p99/max ms", lambda k, n, lv: _pair(lv["systems"][OURS], "gap",
                                                  ("p50", "p99", "max"))),
    ("B/tok", lambda k, n, lv: lv["systems"][OURS]["bytes_per_token"]),
    ("RSS MiB", lambda k, n, lv: lv["systems"][OURS]["rss_mib"]),
    ("peer tokens/s", lambda k, n, lv: lv["systems"][PEER]["tokens_per_s"]),
    ("ours/peer", lambda k, n, lv: lv["ours_over_peer"]),
)


def _pair(row: Mapping[str, Any], kind: str, keys: tuple[str, ...]) -> str:
    return "/".join(f"{row[f'{kind}_{key}_ms']:.1f}" for key in keys)


def table(data: Mapping[str, Any]) -> str:
    """Our figures per engine and level, and the peer's tokens/s, as a markdown table."""
    lines = ["| " + " | ".join(h for h, _ in TABLE) + " |",
             "|" + "|".join("---:" for _ in TABLE) + "|"]
    for kind, result in data["engines"].items():
        for n, level in result["levels"].items():
            lines.append("| " + " | ".join(str(f(kind, n, level)) for _, f in TABLE) + " |")
    return "\n".join(lines)


def draw(data: Mapping[str, Any], path: Path) -> None:
    """Tokens/s (ours, the peer, the ceiling) and CPU per token against N, per engine."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    kinds = list(data["engines"])
    fig = Figure(figsize=(5.5 * len(kinds), 7.5))
    axes = fig.subplots(2, len(kinds), squeeze=False)
    for column, kind in enumerate(kinds):
        levels = data["engines"][kind]["levels"]
        xs = [int(n) for n in levels]
        rate, cpu = axes[0][column], axes[1][column]
        rate.plot(xs, [lv["ceiling"]["tokens_per_s"] for lv in levels.values()], "k--",
                  marker=".", label="ceiling")
        for name, color in ((OURS, "C0"), (PEER, "C1")):
            rows = [lv["systems"][name] for lv in levels.values()]
            rate.plot(xs, [r["tokens_per_s"] for r in rows], color=color, marker="o",
                      label=name)
            for key, dash in (("loop_cpu_us_per_token", "-"), ("step_cpu_us_per_token", ":")):
                cpu.plot(xs, [r[key] for r in rows], dash, color=color, marker="o",
                         label=f"{name} {key.split('_')[0]}")
        _axes(rate, xs, f"{kind}: tokens/s delivered", log_y=True)
        _axes(cpu, xs, f"{kind}: CPU µs per token", log_y=True)
    meta = data["meta"]
    save_figure(fig, path, f"servicebench: {meta['tokens']} tokens a stream, 1 torch thread, "
                f"{meta['started']}", fontsize=9)


def _axes(ax: Any, xs: list[int], title: str, *, log_y: bool) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("concurrent streams N")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)

"""Charts of ``tools.peers.sidebyside`` runs: one run's TTFT and gaps against N (``draw``,
its ``--plot``), and several runs' tokens/s against N, per precision (this command).

::

    for d in float32 bfloat16 int8; do
      STREAMSCOPE_DTYPE=$d python -m tools.peers.sidebyside --llama --no-transformers \\
          --threads 1 --levels 1 8 32 --json results/sbs-$d-t1.json
    done
    python -m tools.peers.sidebyside_chart results/sbs-*.json --out docs/plots/precision.png

One panel per thread count; a line per streamscope run, named by its ``STREAMSCOPE_DTYPE``
(``meta.streamscope_env``), and each run's own ``llama-server`` line in grey beside it:
every ratio in docs/results.md is between two lines of one run, and the grey lines show
how much the peer moved between runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tools.figures import save_figure

OURS, LLAMA = "streamscope", "llama-server"


def series(run: dict[str, Any], system: str) -> tuple[list[int], list[float]]:
    """(levels, tokens/s) of ``system`` in one run's JSON."""
    levels = run["systems"][system]["levels"]
    ns = sorted(int(n) for n in levels)
    return ns, [float(levels[str(n)]["tokens_per_s_counted"]) for n in ns]


def chart(runs: list[dict[str, Any]], out: Path, names: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    threads = sorted({run["meta"]["threads"] for run in runs})
    fig = Figure(figsize=(5.5 * len(threads), 4.2))
    axes = fig.subplots(1, len(threads), squeeze=False)[0]
    for ax, count in zip(axes, threads, strict=True):
        for i, run in enumerate(runs):
            if run["meta"]["threads"] != count:
                continue
            precision = names[i] if names else run["meta"].get("streamscope_env", {}).get(
                "STREAMSCOPE_DTYPE", "default")
            ax.plot(*series(run, OURS), marker="o", label=f"streamscope {precision}")
            if LLAMA in run["systems"]:
                ax.plot(*series(run, LLAMA), color="grey", alpha=0.6, linewidth=1,
                        label=f"llama-server (run of {precision})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams N")
        ax.set_ylabel("tokens/s, all streams")
        ax.set_title(f"{count} thread{'s' if count > 1 else ''}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    model = runs[0]["meta"]["model"]
    save_figure(fig, out, f"{model}, {runs[0]['meta']['max_new_tokens']} tokens a stream, "
                "side by side")


def draw(data: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    ttft_ax, gap_ax = fig.subplots(1, 2)
    styles = {"streamscope": "C0", "llama-server": "C2"}
    for name, system in data["systems"].items():
        color = styles.get(name, "C1")
        levels = sorted(system["levels"], key=int)
        xs = [int(n) for n in levels]
        figs = [system["levels"][n] for n in levels]
        for key, dash in (("ttft_p50_ms", "-"), ("ttft_p99_ms", "--")):
            ttft_ax.plot(xs, [f[key] for f in figs], dash, color=color, marker="o",
                         label=f"{name} {key[5:8]}")
        for key, dash in (("gap_p50_ms", "-"), ("gap_p99_ms", "--"), ("gap_max_ms", ":")):
            gap_ax.plot(xs, [f[key] for f in figs], dash, color=color, marker="o",
                        label=f"{name} {key[4:7]}")
    ceiling = data.get("ceiling")
    if ceiling:
        ttft_ax.axhline(ceiling["ttft_bound_ms"], color="grey", lw=0.8,
                        label="1.3 x (packed prefill + step)")
    for ax, title in ((ttft_ax, "TTFT (ms)"), (gap_ax, "gap between tokens (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["meta"]["levels"], [str(n) for n in data["meta"]["levels"]])
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams N")
        ax.set_title(title)
        ax.legend(fontsize=7)
    meta = data["meta"]
    save_figure(fig, path, f"{meta['model']}, {meta['max_new_tokens']} tokens, "
                f"{meta['threads']} torch thread(s), {meta['started']}", fontsize=9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="sidebyside JSON files")
    parser.add_argument("--out", type=Path, default=Path("results/sidebyside-chart.png"))
    parser.add_argument("--names", nargs="+", default=None,
                        help="a name per run (default: its STREAMSCOPE_DTYPE, or 'default')")
    args = parser.parse_args()
    if args.names and len(args.names) != len(args.runs):
        parser.error("--names needs one name per run")
    chart([json.loads(path.read_text()) for path in args.runs], args.out, args.names)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""``python -m tools.lab EXPERIMENT [options]``: run one experiment and write its results.

::

    python -m tools.lab --list
    python -m tools.lab overlap                       # starts our server (smollm2)
    python -m tools.lab overlap --quick --out /tmp/r  # seconds, tiny-gpt2
    python -m tools.lab sse --url http://127.0.0.1:8000

Options every experiment takes: ``--url`` (measure that server instead of starting one),
``--model``, ``--device``, ``--threads`` (torch threads of the server it starts),
``--quick``, ``--out`` (default ``results/``), ``--seed``; ``python -m tools.lab NAME -h``
shows the experiment's own. Writes ``OUT/NAME.json`` (and ``OUT/NAME.png`` when the
experiment draws one), prints the summary as a table, and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import pkgutil
import random
import sys
import time
from pathlib import Path
from typing import Any

import trio

import tools.lab
from tools.lab.common import (
    QUICK_SERVER,
    REGISTRY,
    Experiment,
    Lab,
    LabError,
    Report,
    format_table,
    open_lab_server,
    write_report,
)


def experiment_modules() -> list[str]:
    """The package's experiment modules (each registers one experiment, its namesake)."""
    return [module.name for module in pkgutil.iter_modules(tools.lab.__path__)
            if module.name != "common" and not module.name.startswith("_")]


def load_experiments(argv: list[str] | None = None) -> None:
    """Import the experiment ``argv`` names, or every one (``--list``, ``-h``, a name that
    is no experiment: the parser lists them all); each registers itself.

    Only the one named: some experiments import torch (``precision``), which would cost
    every other run of the lab (one per experiment in the test suite) a second or two.
    """
    args = sys.argv[1:] if argv is None else argv
    named = next((a for a in args if not a.startswith("-")), None)
    modules = experiment_modules()
    for name in [named] if named in modules else modules:
        importlib.import_module(f"tools.lab.{name}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="measure this server instead of starting ours")
    common.add_argument(
        "--model",
        help="the model of the server started (default: "
        "the app's, smollm2; tiny-gpt2 with --quick)",
    )
    common.add_argument("--device", help="cpu or cuda for the server started")
    common.add_argument(
        "--threads",
        type=int,
        help="torch threads of the server started (default: torch's; 1 with --quick)",
    )
    common.add_argument("--quick", action="store_true", help="a seconds-long form")
    common.add_argument("--out", type=Path, default=Path("results"))
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--no-progress", action="store_true")
    parser = argparse.ArgumentParser(
        prog="python -m tools.lab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--list", action="store_true", help="list the experiments")
    commands = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    for exp in REGISTRY.values():
        sub = commands.add_parser(exp.name, help=exp.help, description=exp.help, parents=[common])
        if exp.arguments is not None:
            exp.arguments(sub)
    args = parser.parse_args(argv)
    if args.list or not args.experiment:
        for exp in REGISTRY.values():
            print(f"{exp.name:<12} {exp.help}")
        raise SystemExit(0 if args.list else 2)
    return args


def server_settings(exp: Experiment, args: argparse.Namespace) -> dict[str, object]:
    chosen = {"model": args.model, "device": args.device, "threads": args.threads}
    if args.quick:
        chosen = {k: QUICK_SERVER[k] if v is None else v for k, v in chosen.items()}
    return {**exp.server, **{k: v for k, v in chosen.items() if v is not None}}


async def run_experiment(
    exp: Experiment, args: argparse.Namespace
) -> tuple[Report, dict[str, Any]]:
    settings = server_settings(exp, args)

    async def measure(url: str, owns: bool) -> tuple[Report, dict[str, Any]]:
        lab = Lab(exp.name, args, url, args.quick, owns, settings, random.Random(args.seed))
        started = time.perf_counter()
        before = await lab.stats() if url else None
        report = await exp.run(lab)
        elapsed_s = time.perf_counter() - started
        # Our own server has no other clients: once idle, its figures show what the
        # experiment left behind (blocks still reserved would be a leak).
        idle_after: bool | None = None
        after: dict[str, Any] | None = None
        if owns and url:
            try:
                after, idle_after = await lab.wait_idle(), True
            except LabError:  # something was left running: record it, keep the report
                after, idle_after = await lab.stats(), False
        elif url:
            after = await lab.stats()
        meta = {
            "experiment": exp.name,
            "argv": sys.argv[1:],
            "quick": args.quick,
            "url": url,
            "own_server": owns,
            "server_settings": settings if owns else None,
            "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "elapsed_s": round(elapsed_s, 2),
            "stats_before": before,
            "stats_after": after,
            "idle_after": idle_after,
        }
        return report, meta

    if args.url:
        return await measure(args.url.rstrip("/"), False)
    if exp.own_servers:  # it starts each server it measures: none of ours idles beside
        return await measure("", True)
    async with open_lab_server(settings) as url:
        return await measure(url, True)


def main(argv: list[str] | None = None) -> int:
    load_experiments(argv)
    args = parse_args(argv)
    exp = REGISTRY[args.experiment]
    report, meta = trio.run(run_experiment, exp, args)
    written = write_report(args.out, exp.name, report, meta)
    print(f"\n{exp.name}{' (quick)' if args.quick else ''}: {meta['elapsed_s']} s")
    print(format_table(report.summary))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

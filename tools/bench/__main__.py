"""``python -m tools.bench NAME [options]``: run one engine benchmark and write its results.

::

    python -m tools.bench --list
    python -m tools.bench step --batches 1 8 32        # writes results/step.json
    python -m tools.bench prefill --quick --out /tmp/r # seconds, a tiny model

Options every bench takes: ``--model`` (default the embedded smollm2; tiny-llama with
``--quick``), ``--threads`` (torch threads; 1 keeps a shared machine's other work from
stalling every kernel of a pass), ``--quick`` (the tiny model), ``--out`` (default
``results/``); ``python -m tools.bench NAME -h`` shows the bench's own. Writes
``OUT/NAME.json`` (the summary first, then how it was run, then the raw figures) and
``OUT/NAME.png`` where the bench draws one, prints the summary as a table, and exits 0.
Shaped like ``python -m tools.lab``, whose report writer and table it uses.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import pkgutil
import sys
import time
from pathlib import Path

import tools.bench
from tools.bench.common import REGISTRY
from tools.lab.common import format_table, write_report

QUICK_MODEL = "tiny-llama"


def load_benches() -> None:
    """Import every bench module of the package; each registers itself."""
    for module in pkgutil.iter_modules(tools.bench.__path__):
        if module.name != "common" and not module.name.startswith("_"):
            importlib.import_module(f"tools.bench.{module.name}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", help="default: smollm2 (tiny-llama with --quick)")
    common.add_argument("--threads", type=int, default=None, help="torch threads")
    common.add_argument("--precision", default="float32",
                        help="the weights' (engine.precision; auto: the app's default)")
    common.add_argument("--quick", action="store_true", help="the tiny model: seconds")
    common.add_argument("--out", type=Path, default=Path("results"))
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the benches")
    commands = parser.add_subparsers(dest="bench", metavar="BENCH")
    for one in REGISTRY.values():
        sub = commands.add_parser(one.name, help=one.help, description=one.help,
                                  parents=[common])
        if one.arguments is not None:
            one.arguments(sub)
    args = parser.parse_args(argv)
    if args.list or not args.bench:
        for one in REGISTRY.values():
            print(f"{one.name:<12} {one.help}")
        raise SystemExit(0 if args.list else 2)
    if args.model is None:
        args.model = QUICK_MODEL if args.quick else "smollm2"
    return args


def main(argv: list[str] | None = None) -> int:
    load_benches()
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    report = REGISTRY[args.bench].run(args)
    meta = {"bench": args.bench, "argv": sys.argv[1:] if argv is None else argv,
            "options": {k: str(v) if isinstance(v, Path) else v
                        for k, v in vars(args).items() if k not in ("list", "bench")},
            "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "elapsed_s": round(time.perf_counter() - started, 2)}
    written = write_report(args.out, args.bench, report, meta)
    print(f"\n{args.bench}: {meta['elapsed_s']} s")
    print(format_table(report.summary))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

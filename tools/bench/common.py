"""What a bench is to the runner: a name, its own options, and ``run(args) -> Report``.

A bench registers itself with ``@bench(...)`` when its module is imported. Its report is
the lab's (``tools.lab.common.Report``: a summary, the raw figures, an optional plot), and
the runner writes it as the lab writes an experiment's, so every benchmark's JSON has the
same shape: the summary first, then how it was run, then the raw figures.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from tools.lab.common import Report

Arguments = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Bench:
    name: str
    help: str
    run: Callable[[argparse.Namespace], Report]
    arguments: Arguments | None


REGISTRY: dict[str, Bench] = {}


def bench(name: str, help: str, *, arguments: Arguments | None = None
          ) -> Callable[[Callable[[argparse.Namespace], Report]],
                        Callable[[argparse.Namespace], Report]]:
    """Register ``def run(args) -> Report`` as ``python -m tools.bench NAME``."""

    def register(run: Callable[[argparse.Namespace], Report]
                 ) -> Callable[[argparse.Namespace], Report]:
        if name in REGISTRY:
            raise ValueError(f"two benches are called {name!r}")
        REGISTRY[name] = Bench(name, help, run, arguments)
        return run

    return register

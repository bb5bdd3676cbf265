"""How the tools write a chart: its title, a tight layout, its folder made, 110 dpi.

Why a module: every PNG under ``docs/plots`` is read beside the others, so they are
written one way; the figures themselves are each tool's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_figure(fig: Any, path: Path, title: str, *, fontsize: float | None = None) -> None:
    """Title ``fig`` (a matplotlib figure), lay it out and write it to ``path``."""
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)

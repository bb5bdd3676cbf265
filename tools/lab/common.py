"""What every lab experiment shares: the registry, the ``Lab`` it runs in, its output.

Adding an experiment
--------------------
Write ``tools/lab/NAME.py``; ``python -m tools.lab`` imports every module of the package
(except ``common`` and names starting with ``_``), so the decorator is the whole
registration::

    from tools.lab.common import Lab, Report, experiment
    from tools.load_runner import run_streams
    from tools.records import StreamRequest

    def arguments(parser):                      # optional: the experiment's own options
        parser.add_argument("--readers", type=int, default=None)

    @experiment("slowclient", "one slow reader among eight, per policy",
                server={"queue_limit": 8}, arguments=arguments)
    async def slowclient(lab: Lab) -> Report:
        tokens = lab.pick(full=64, quick=4)     # the full size, or the --quick size
        result = await run_streams(lab.url, [StreamRequest(p, tokens, True)
                                             for p in lab.prompts(8)])
        await lab.wait_idle()                   # between conditions: nothing running
        return Report(summary={"gap_p99_ms_1": ...}, raw={"runs": [result.to_json()]},
                      plot=draw)                # draw(fig): optional

Conventions
-----------
* The server. Unless ``--url`` is given, the lab starts the lab's server (``_app.py``:
  ours plus the laboratory devices) on a loopback port (``tools/server.py``) with
  ``--model``, ``--device``, ``--threads`` and the experiment's ``server`` settings
  (``{"cache_blocks": 1024}`` becomes ``STREAMSCOPE_CACHE_BLOCKS=1024``, and the lab's
  own ``{"lab_pad_bytes": 65536}`` ``STREAMSCOPE_LAB_PAD_BYTES=65536``), and stops it
  afterwards. For a condition that needs another configuration (a server setting, not a
  per-request field such as ``policy``), ``async with
  lab.server(lab_detect_disconnect=False) as url:`` starts one more with the
  same model; with ``--url`` that raises ``LabError`` (the lab cannot reconfigure a
  server it does not own). An experiment that measures only servers it starts this way
  says ``own_servers=True``: the lab then starts none of its own (``lab.url`` is empty,
  and ``meta`` has no ``/stats`` of one).
* ``--quick``: a seconds-long form for the test suite: tiny-gpt2 on the CPU with one
  torch thread, few streams, few tokens (``lab.pick``). It must produce the same summary
  keys as the full form, so that a test can check them.
* ``Report.summary``: the headline figures, JSON scalars or small dicts keyed by the
  condition; printed as a table and written first in ``results/NAME.json``. Name keys
  ``<figure>_<condition>`` (``ttft_p50_32``, ``speedup_32``); times are in ms unless the
  key ends in ``_s``.
  ``Report.raw``: everything else, JSON-serialisable (``LoadResult.to_json()`` for a
  run). The lab adds ``meta``: the command, the server's ``/stats`` before and after,
  the times.
* ``Report.plot``: ``draw(fig)`` gets an empty matplotlib ``Figure`` (Agg backend) and
  fills it; the lab saves it as ``results/NAME.png``.
* Randomness comes from ``lab.rng`` (seeded by ``--seed``), so a run can be repeated.
* Traffic goes only to loopback (or the ``--url`` given); every client built here has
  ``trust_env=False`` so a proxy variable cannot reroute it.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

from tools.lab.naive import NAIVE, NAIVE_QUEUE_POLICY
from tools.prompts import load_prompts
from tools.server import open_server

# What --quick means when --model/--device/--threads are not given.
QUICK_SERVER = {"model": "tiny-gpt2", "device": "cpu", "threads": 1}
LAB_APP = "tools.lab._asgi:app"  # the service plus the laboratory devices (_app.py)
IDLE_TIMEOUT_S = 120.0  # a server that is not idle by then is stuck
IDLE_POLL_S = 0.05


class LabError(RuntimeError):
    """The experiment cannot run as asked (the message says why)."""


@dataclass
class Report:
    """What an experiment returns; see the module docstring's conventions."""

    summary: dict[str, Any]
    raw: dict[str, Any] = field(default_factory=dict)
    plot: Callable[[Any], None] | None = None  # draw(fig: matplotlib.figure.Figure)


@dataclass(frozen=True)
class Experiment:
    name: str
    help: str
    run: Callable[[Lab], Awaitable[Report]]
    server: Mapping[str, object]  # STREAMSCOPE_* settings for the server the lab starts
    arguments: Callable[[argparse.ArgumentParser], None] | None
    own_servers: bool = False  # it starts every server it measures (``lab.server``)


REGISTRY: dict[str, Experiment] = {}


def experiment(
    name: str,
    help: str,
    *,
    server: Mapping[str, object] | None = None,
    arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    own_servers: bool = False,
) -> Callable[[Callable[[Lab], Awaitable[Report]]], Callable[[Lab], Awaitable[Report]]]:
    """Register ``async def run(lab) -> Report`` as ``python -m tools.lab NAME``."""

    def register(run: Callable[[Lab], Awaitable[Report]]) -> Callable[[Lab], Awaitable[Report]]:
        if name in REGISTRY:
            raise LabError(f"two experiments are called {name!r}")
        REGISTRY[name] = Experiment(name, help, run, dict(server or {}), arguments,
                                    own_servers)
        return run

    return register


@dataclass
class Lab:
    """The context an experiment runs in: its server, its options, its randomness."""

    name: str
    args: argparse.Namespace  # every option, the experiment's own included
    url: str  # the server under measurement ("" for an experiment with own_servers)
    quick: bool
    owns_server: bool
    server_settings: dict[str, object]  # what the lab started its server with
    rng: random.Random

    @property
    def progress(self) -> bool:
        """Whether to show tqdm bars (``--no-progress`` turns them off)."""
        return not getattr(self.args, "no_progress", False)

    def pick(self, full: Any, quick: Any) -> Any:
        """``full``, or ``quick`` under ``--quick``."""
        return quick if self.quick else full

    def option(self, name: str, full: Any, quick: Any) -> Any:
        """The experiment's option ``--name`` if given, else ``pick(full, quick)``."""
        value = getattr(self.args, name, None)
        return self.pick(full, quick) if value is None else value

    def prompts(self, count: int | None = None) -> list[str]:
        """The first ``count`` prompts of tools/prompts.txt, cycling past the 32."""
        prompts = load_prompts()
        count = len(prompts) if count is None else count
        return [prompts[i % len(prompts)] for i in range(count)]

    def client(self, url: str | None = None, *, timeout: float = 60.0) -> httpx.AsyncClient:
        """An httpx client for the server (or ``url``), loopback only."""
        return httpx.AsyncClient(base_url=url or self.url, timeout=timeout, trust_env=False)

    async def stats(
        self, url: str | None = None, *, client: httpx.AsyncClient | None = None
    ) -> dict[str, Any]:
        """``GET /stats``, on ``client`` if given (pollers pass one, so that each poll
        does not build a client and its TLS context on the cores being measured).

        Cancellation: nothing to undo: a read; a client made here is closed by its
        ``async with``.
        """
        if client is None:
            async with self.client(url) as own:
                return await self.stats(client=own)
        response = await client.get("/stats")
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    async def wait_idle(self, url: str | None = None) -> dict[str, Any]:
        """Wait until the server runs, waits for and streams nothing; return its /stats.

        Raises:
            LabError: not idle after ``IDLE_TIMEOUT_S``.

        Cancellation: nothing to undo: reads and waits; its client is closed by its
        ``async with``.
        """
        keys = ("running", "waiting", "streams_open")
        stats: dict[str, Any] = {}
        async with self.client(url) as client:
            with trio.move_on_after(IDLE_TIMEOUT_S):
                while True:
                    stats = await self.stats(client=client)
                    if all(not stats.get(k) for k in keys):
                        return stats
                    await trio.sleep(IDLE_POLL_S)
        raise LabError(
            f"the server was not idle after {IDLE_TIMEOUT_S:.0f} s: "
            f"{ {k: stats.get(k) for k in keys} }"
        )

    @asynccontextmanager
    async def server(self, **settings: object) -> AsyncIterator[str]:
        """Another server like the lab's, with ``settings`` changed; yields its URL.

        Raises:
            LabError: the lab was given ``--url``.
        """
        if not self.owns_server:
            raise LabError(
                f"{self.name} needs a server it can configure ({settings}); run it without --url"
            )
        async with open_lab_server({**self.server_settings, **settings}) as url:
            yield url


def lab_server_settings(settings: Mapping[str, object]) -> dict[str, object]:
    """``settings`` as the lab's server takes them: ``policy="naive"``, no policy of the
    service, becomes the lab's device (``naive.py``: ``STREAMSCOPE_LAB_NAIVE``, on
    unbounded queues); the rest as given."""
    if settings.get("policy") == NAIVE:
        return {**settings, "policy": NAIVE_QUEUE_POLICY.value, "lab_naive": "true"}
    return dict(settings)


def open_lab_server(settings: Mapping[str, object]) -> AbstractAsyncContextManager[str]:
    """``open_server`` with the lab's settings (``lab_server_settings``): ``threads``
    (torch's intra-op threads) goes to the process as ``OMP_NUM_THREADS``, the rest as
    ``STREAMSCOPE_*``; the server is the lab's (``LAB_APP``)."""
    settings = lab_server_settings(settings)
    threads = settings.get("threads")
    env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    return open_server({k: v for k, v in settings.items() if k != "threads"}, env=env,
                       app=LAB_APP)


# -- figures -----------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), or None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None, or None."""
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def ms(seconds: float | None, digits: int = 1) -> float | None:
    return None if seconds is None else round(seconds * 1000, digits)


def spread(values: Sequence[float | None]) -> list[float] | None:
    """[min, max] of the values that are not None (a range over repetitions), or None."""
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


def plot_gap_cdfs(axis: Any, curves: Mapping[str, Sequence[float]], *, whose: str) -> None:
    """Each label's gaps (seconds) as a distribution on a log axis in ms: the share of
    gaps at most x. A label with no gaps is left out."""
    for label, values in curves.items():
        gaps = sorted(g * 1000 for g in values)
        if gaps:
            axis.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=label)
    axis.set_xscale("log")
    axis.set_xlabel(f"gap between {whose} tokens (ms)")
    axis.set_ylabel("share of gaps at most this")
    axis.grid(alpha=0.3)
    axis.legend()


# -- output ------------------------------------------------------------------------------------


def format_table(summary: Mapping[str, Any]) -> str:
    """The summary as two columns; nested dicts become ``key.subkey`` rows."""
    rows: list[tuple[str, str]] = []

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                add(f"{prefix}.{key}", inner)
        else:
            rows.append((prefix, json.dumps(value) if not isinstance(value, str) else value))

    for key, value in summary.items():
        add(key, value)
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_report(out: Path, name: str, report: Report, meta: Mapping[str, Any]) -> list[Path]:
    """Write ``out/NAME.json`` (summary first, then meta, then raw) and the plot."""
    out.mkdir(parents=True, exist_ok=True)
    document = {"summary": report.summary, "meta": dict(meta), **report.raw}
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(document, indent=1, default=str) + "\n")
    written = [json_path]
    if report.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        fig = Figure(figsize=(11, 4.2), layout="constrained")
        report.plot(fig)
        png_path = out / f"{name}.png"
        fig.savefig(png_path, dpi=110)
        written.append(png_path)
    return written

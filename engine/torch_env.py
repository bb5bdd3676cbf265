"""What torch and its OpenMP runtime read from the environment once: set before torch loads.

Two variables change a CPU decode step's time without changing a bit of its results,
and both are read only when torch is imported (libgomp's at its load, c10's at torch's
first allocation), so the engine's load sets them before it imports torch
(``prepare``), and each only where the environment does not already say (a user's
``THP_MEM_ALLOC_ENABLE=0`` or ``GOMP_SPINCOUNT=300000`` stands):

* ``GOMP_SPINCOUNT=10000`` (``OMP_SPIN``). torch's CPU wheel runs its kernels on GNU
  OpenMP, whose idle workers busy-wait for the next parallel region for 300,000 spins
  (milliseconds) before they sleep. A decode step is hundreds of short parallel
  regions with Python between them, and the server has other threads that need a core
  during a step: the event loop routing and writing the tokens, and the clients on the
  same machine. Where there are as many OpenMP threads as cores (``OMP_NUM_THREADS``,
  torch's default), a worker spinning through the step's Python and through the gap
  between steps holds a core those threads must then take from a kernel, and the kernel's
  parallel region waits for the thread it lost. With 10,000 spins (a fraction of a
  millisecond) a worker stays ready within a step's run of kernels and yields the core
  sooner after it. ``OMP_WAIT_POLICY=passive`` (no spinning) is the other end: a worker
  sleeps after every region and each wake costs more than the region.
* ``THP_MEM_ALLOC_ENABLE=1``. torch's CPU allocator then aligns allocations of 2 MiB and
  more to 2 MiB and asks the kernel for transparent huge pages for them (``madvise``:
  pytorch/pytorch#107697; PyTorch's CPU performance guide recommends it; off by default
  because it rounds such allocations up). A decode step reads every weight once (about
  120 MB a token in ``int4``) and gathers each row's keys and values from a cache of
  many megabytes, all of it cold: with 4 KiB pages each 4 KiB of it is a TLB miss (and
  under a hypervisor, a two-level page walk). It takes effect where the kernel's mode
  (``/sys/kernel/mm/transparent_hugepage/enabled``) is ``madvise`` (most distributions'
  default) or ``always``; with ``never``, nothing does.

Measured on the 2-core AMD EPYC of issue 44, one stream of the embedded model in
``int4`` over HTTP, servers started alternately (docs/results.md, "OpenMP's spin and huge
pages"). A process that imported torch before the engine's load keeps what it had:
``prepare`` says so, and changes nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

OMP_SPIN = "10000"
DEFAULTS = {"GOMP_SPINCOUNT": OMP_SPIN, "THP_MEM_ALLOC_ENABLE": "1"}
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class TorchEnvironment:
    """What ``prepare`` found and did, for the start's log line."""

    applied: dict[str, str]  # the variables it set
    kept: dict[str, str]  # those the environment already had: left as they were
    torch_was_loaded: bool  # torch was imported before: nothing could be set
    huge_page_mode: str | None  # the kernel's THP mode (madvise, always, never); None: no THP

    def describe(self) -> str:
        if self.torch_was_loaded:
            return "torch was imported before the engine's load: its environment stands"
        said = [f"{k}={v}" for k, v in self.applied.items()]
        said += [f"{k}={v} (the environment's)" for k, v in self.kept.items()]
        return ", ".join(said) + f"; transparent huge pages: {self.huge_page_mode or 'none'}"


def prepare() -> TorchEnvironment:
    """Set ``DEFAULTS`` where the environment has none, if torch is not imported yet."""
    loaded = "torch" in sys.modules
    applied: dict[str, str] = {}
    kept: dict[str, str] = {}
    for name, value in DEFAULTS.items():
        if name in os.environ:
            kept[name] = os.environ[name]
        elif not loaded:
            os.environ[name] = value  # putenv: what libgomp's and c10's getenv read
            applied[name] = value
    return TorchEnvironment(applied, kept, loaded, huge_page_mode())


def huge_page_mode() -> str | None:
    """The kernel's transparent huge page mode, the bracketed word of ``THP_MODE``."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_page_bytes() -> int | None:
    """This process's anonymous memory in huge pages (``/proc/self/smaps_rollup``)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

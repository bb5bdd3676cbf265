"""The serving process as ``tools.servicebench`` reads it: which process serves, its
threads' CPU and run-queue time, its memory, and the CPU and wait figures of a window.

Why a module of its own: every CPU and wait figure of the benchmark rests on reading
``/proc`` (and the server's ``/stats``) just before and just after the client's window.
The command decides when to read; this module says what is read and how two readings
become a figure (``tools.servicebench``'s docstring defines each one). Linux only.
"""

from __future__ import annotations

import os
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


def serving_pid(root: int) -> int:
    """The process that serves: of ``root`` and its descendants, the largest resident
    set (hypercorn's main process spawns its worker; uvicorn serves in its own)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with suppress(OSError):
                parents[int(entry)] = int(_stat_fields(int(entry))[1])
    family, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return max(family, key=lambda pid: memory_mib(pid)[0])


def _stat_fields(pid: int, tid: int | None = None) -> list[str]:
    """``/proc/<pid>[/task/<tid>]/stat``'s fields after the command name, from state on."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    text = Path(path).read_text()
    return text[text.rindex(")") + 2:].split()


def _ticks_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@dataclass(frozen=True)
class ThreadTimes:
    name: str
    cpu_s: float  # on a CPU
    queued_s: float  # runnable, waiting for a CPU (0 without schedstat)


def thread_cpu(pid: int) -> dict[int, ThreadTimes]:
    """Every thread of ``pid``: its name, CPU seconds and run-queue seconds
    (``schedstat``'s first two fields, in ns; else ``stat``'s CPU ticks alone)."""
    out: dict[int, ThreadTimes] = {}
    for entry in os.listdir(f"/proc/{pid}/task"):
        tid = int(entry)
        with suppress(OSError):
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            try:
                fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                out[tid] = ThreadTimes(name, int(fields[0]) / 1e9, int(fields[1]) / 1e9)
            except (OSError, ValueError, IndexError):
                out[tid] = ThreadTimes(name, _ticks_s(_stat_fields(pid, tid)), 0.0)
    return out


def memory_mib(pid: int) -> tuple[float, float]:
    """VmRSS and VmHWM of ``pid`` in MiB (0 for a process without them)."""
    values = {"VmRSS": 0.0, "VmHWM": 0.0}
    with suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


@dataclass
class Snapshot:
    at: float
    threads: dict[int, ThreadTimes]
    process_s: float
    stats: dict[str, Any]


def snapshot(url: str, pid: int, stats_first: bool) -> Snapshot:
    """The CPU of the server at ``url`` (serving process ``pid``) and its ``/stats``;
    ``/stats`` is asked outside the window (before the CPU is read at its start, after
    at its end)."""
    def stats() -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(url + "/stats", trust_env=False).json()
        return answer

    before = stats() if stats_first else {}
    taken = Snapshot(time.perf_counter(), thread_cpu(pid), _ticks_s(_stat_fields(pid)), before)
    if not stats_first:
        taken.stats = stats()
    return taken


def cpu_figures(start: Snapshot, end: Snapshot, pid: int, tokens: int) -> dict[str, Any]:
    """CPU per token of the loop thread, the stepping thread, the rest, the process; the
    loop's and the stepping thread's run-queue time over the window."""
    zero = ThreadTimes("", 0.0, 0.0)
    deltas = {tid: ThreadTimes(t.name, t.cpu_s - start.threads.get(tid, zero).cpu_s,
                               t.queued_s - start.threads.get(tid, zero).queued_s)
              for tid, t in end.threads.items()}
    loop = deltas.pop(pid, zero)
    step_tid = max(deltas, key=lambda t: deltas[t].cpu_s, default=None)
    step = deltas.pop(step_tid) if step_tid is not None else zero
    per, window = 1e6 / max(tokens, 1), end.at - start.at
    return {
        "loop_cpu_us_per_token": round(loop.cpu_s * per, 2),
        "step_cpu_us_per_token": round(step.cpu_s * per, 2),
        "other_cpu_us_per_token": round(sum(t.cpu_s for t in deltas.values()) * per, 2),
        "process_cpu_us_per_token": round((end.process_s - start.process_s) * per, 2),
        "step_thread": step.name, "step_cpu_s": round(step.cpu_s, 4),
        "loop_queued_share": round(loop.queued_s / window, 4),
        "step_queued_share": round(step.queued_s / window, 4),
    }


def wait_figures(start: Snapshot, end: Snapshot) -> dict[str, Any]:
    """``step_wait_share`` and ``step_idle_share`` from ``/stats`` (``tools.servicebench``'s
    docstring)."""
    window = end.at - start.at
    steps = end.stats.get("steps", 0) - start.stats.get("steps", 0)
    median = end.stats.get("median_decode_step_ms") or 0.0
    idle = max(0.0, 1 - steps * median / 1000 / window) if window > 0 else None
    out: dict[str, Any] = {"engine_steps": steps, "median_decode_step_ms": median,
                           "step_idle_share": None if idle is None else round(idle, 4)}
    if "loop_wait_s" in end.stats and window > 0:
        waited = end.stats["loop_wait_s"] - start.stats.get("loop_wait_s", 0.0)
        out.update(step_wait_share=round(waited / window, 4),
                   step_wait_method="/stats loop_wait_s difference / window")
    else:
        out.update(step_wait_share=out["step_idle_share"],
                   step_wait_method="1 - /stats steps difference x median_decode_step_ms "
                                    "/ window")
    return out

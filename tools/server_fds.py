"""A server's open file descriptors, counted from ``/proc``: the lab's check for leaked files.

Why a module of its own: the leak and fuzz experiments (``tools/lab/leak.py``,
``tools/lab/fuzz.py``) count the files the server's processes hold before their clients
come and after they have gone; more afterwards is a leak. It inspects processes, not
HTTP, so it stays apart from the clients. Linux only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import trio


def server_pids(port: int) -> list[int]:
    """The processes holding the socket that listens on loopback ``port`` (hypercorn's
    main process and its worker), found through ``/proc/net/tcp``; Linux only."""
    wanted = f"0100007F:{port:04X}"
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[1] == wanted and cols[3] == "0A":  # 0A: LISTEN
            inodes.add(f"socket:[{cols[9]}]")
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
        except OSError:
            continue  # gone, or not ours to read
    return sorted(pids)


def open_fds(pids: list[int]) -> dict[int, int]:
    """``{pid: number of open file descriptors}``, for the pids still there."""
    counts = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            counts[pid] = len(os.listdir(f"/proc/{pid}/fd"))
    return counts


FDS_QUIET_S = 0.5  # the lab's own polling connection closes within this


async def settled_fds(
    pids: list[int], baseline: dict[int, int] | None = None, timeout_s: float = 10.0
) -> dict[int, int]:
    """``open_fds(pids)`` once the server has closed what its clients closed: after
    ``FDS_QUIET_S``, and then, given a ``baseline``, as soon as the total is no more than
    the baseline's (or after ``timeout_s``: what is left open then is a leak).

    Cancellation: nothing to undo.
    """
    await trio.sleep(FDS_QUIET_S)
    with trio.move_on_after(timeout_s):
        # A process's open files come with no event to wait on.
        while baseline is not None and sum(open_fds(pids).values()) > sum(baseline.values()):  # noqa: ASYNC110
            await trio.sleep(0.1)
    return open_fds(pids)

"""What one write and one wait of a stream's writer cost in Trio, the ways the body can do them.

::

    python -m tools.writebench [--writes 20000] [--rounds 3] [--json FILE]

Why: with a fast engine the serving path sets the speed (issue 21), and a stream's writer
does two things per write: it waits for its next items, then writes them. Both have a
plain form and the form Trio's high-level API gives, and their difference is paid once
per write of every stream. This measures them alone, in one process, the thread's own
CPU time (``time.thread_time``: user and system) per operation, each variant alternated
with the others ``--rounds`` times so that they share the machine's noise; the median
round is reported.

Writes, a 64-byte chunk to a TCP loopback connection (``TCP_NODELAY``) that a thread
drains:

* ``send_all``: ``trio.SocketStream.send_all``, as hypercorn writes: a schedule point
  per write (``_try_sync``'s ``cancel_shielded_checkpoint``), and with it a trip
  through the scheduler and its ``epoll_wait``;
* ``send_all_locked_shielded``: the same under a lock and a shielding scope, as
  hypercorn's ``protocol_send`` and our earlier hot path did;
* ``os_write``: one non-blocking ``os.write`` on the socket's descriptor, ``send_all``
  only for what the socket does not take at once (``app/edge/http_fixes.py`` now).

Waits, a task parked on a ``ParkingLot`` and woken by another task, per cycle:

* ``park``: the wait alone;
* ``park_under_move_on_after``: the wait inside ``trio.move_on_after(15)``, as the
  body's keep-alive was timed before ``streams/keepalive.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

CHUNK = b"3c\r\n" + b"x" * 60 + b"\r\n"
WRITES = ("send_all", "send_all_locked_shielded", "os_write")
WAITS = ("park", "park_under_move_on_after")


def _drain(sock: socket.socket) -> None:
    while sock.recv(1 << 20):
        pass


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    writer = socket.create_connection(listener.getsockname())
    reader, _ = listener.accept()
    listener.close()
    writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.setblocking(False)
    return writer, reader


async def time_writes(stream: trio.SocketStream, variant: str, n: int) -> float:
    """Microseconds of this thread's CPU per write of ``CHUNK``."""
    lock = trio.StrictFIFOLock()
    started = time.thread_time()
    for _ in range(n):
        if variant == "send_all":
            await stream.send_all(CHUNK)
        elif variant == "send_all_locked_shielded":
            lock.acquire_nowait()
            try:
                with trio.CancelScope(shield=True):
                    await stream.send_all(CHUNK)
            finally:
                lock.release()
        else:
            try:
                written = os.write(stream.socket.fileno(), CHUNK)
            except BlockingIOError:
                written = 0
            if written < len(CHUNK):
                await stream.send_all(CHUNK[written:])
    return (time.thread_time() - started) / n * 1e6


async def time_waits(variant: str, n: int) -> float:
    """Microseconds of this thread's CPU per park-and-wake cycle."""
    lot = trio.lowlevel.ParkingLot()
    woken = 0

    async def waiter() -> None:
        nonlocal woken
        for _ in range(n):
            if variant == "park_under_move_on_after":
                with trio.move_on_after(15.0):
                    await lot.park()
            else:
                await lot.park()
            woken += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.lowlevel.checkpoint()
        started = time.thread_time()
        while woken < n:
            lot.unpark_all()
            await trio.lowlevel.checkpoint()
        return (time.thread_time() - started) / n * 1e6


async def measure(n: int, rounds: int) -> dict[str, list[float]]:
    writer, reader = loopback_pair()
    threading.Thread(target=_drain, args=(reader,), daemon=True).start()
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(writer))
    samples: dict[str, list[float]] = {name: [] for name in (*WRITES, *WAITS)}
    for _ in range(rounds):
        for variant in WRITES:
            samples[variant].append(await time_writes(stream, variant, n))
        for variant in WAITS:
            samples[variant].append(await time_waits(variant, n))
    await stream.aclose()
    return samples


def summary(samples: dict[str, list[float]]) -> dict[str, Any]:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "us_per_op": medians,
        "write_saving_us": medians["send_all_locked_shielded"] - medians["os_write"],
        "wait_saving_us": medians["park_under_move_on_after"] - medians["park"],
        "samples_us": samples,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.writebench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writes", type=int, default=20_000, help="operations a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {"writes": args.writes, "rounds": args.rounds, "load_avg": os.getloadavg(),
              **summary(trio.run(measure, args.writes, args.rounds))}
    for name, value in result["us_per_op"].items():
        print(f"{name:28s} {value:7.2f} us", file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

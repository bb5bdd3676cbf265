"""TLS (issue 25, item 1): ``streamscope serve --certfile --keyfile`` (or the same in its
``--config``) and ``hypercorn -k trio --certfile ... app:app``, with a self-signed
certificate that ``openssl`` makes at test time; ALPN offers ``h2`` and ``http/1.1``.

The real-process tests run the console script on the tiny model, as ``test_serve.py``
does, and end with SIGTERM: the drain, a GOAWAY on every HTTP/2 connection once it has
no stream running (``h2_retire.goaway_on_drain``), exit status 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from app.edge.serve import ServeError, make_config
from app.settings import Settings
from tests.http2_clients import H2Client
from tests.http_clients import long_body, parse_sse, stream_body
from tests.test_app_drain import POLL_S, REPO_ROOT, SERVER_ENV, START_TIMEOUT_S, WAIT_TIMEOUT_S
from tests.tls import Certificate, make_certificate

STREAMSCOPE = str(Path(sys.executable).parent / "streamscope")  # pip install -e . made it
_LISTENING = re.compile(r"streamscope serve: listening on https://127\.0\.0\.1:(\d+);")
_HYPERCORN_ON = re.compile(r"Running on https://127\.0\.0\.1:(\d+)")


# -- the configuration, in-process -------------------------------------------------------


def test_certfile_and_keyfile_from_the_options_or_the_config_file(
    tmp_path: Path, certificate: Certificate
) -> None:
    settings = Settings()
    from_options = make_config(settings, certfile=certificate.cert, keyfile=certificate.key)
    assert from_options.ssl_enabled and from_options.alpn_protocols == ["h2", "http/1.1"]

    toml = tmp_path / "hypercorn.toml"
    toml.write_text(f'certfile = "{certificate.cert}"\nkeyfile = "{certificate.key}"\n')
    from_file = make_config(settings, toml)
    assert (from_file.certfile, from_file.keyfile) == (str(certificate.cert),
                                                        str(certificate.key))
    other = make_certificate(tmp_path)
    overridden = make_config(settings, toml, certfile=other.cert, keyfile=other.key)
    assert (overridden.certfile, overridden.keyfile) == (str(other.cert), str(other.key))
    assert not make_config(settings).ssl_enabled  # no TLS unless asked


def test_half_a_tls_setup_or_a_bad_key_is_refused(
    tmp_path: Path, certificate: Certificate
) -> None:
    with pytest.raises(ServeError, match="keyfile is set, certfile is not"):
        make_config(Settings(), keyfile=certificate.key)
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key\n")
    with pytest.raises(ServeError, match="TLS: cannot load certfile"):
        make_config(Settings(), certfile=certificate.cert, keyfile=bad)
    done = subprocess.run([STREAMSCOPE, "serve", "--certfile", str(certificate.cert)],
                          cwd=REPO_ROOT, env={**os.environ, **SERVER_ENV},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "TLS needs both a certfile and a keyfile" in done.stderr


# -- real processes ----------------------------------------------------------------------


@asynccontextmanager
async def tls_process(
    tmp_path: Path, command: Sequence[str], listening: re.Pattern[str]
) -> AsyncIterator[tuple[trio.Process, int, Path]]:
    """``command`` on the tiny model, until it says where it listens and /ready says
    200; killed at the end if still running."""
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log_file:
        proc = await trio.lowlevel.open_process(
            list(command), cwd=REPO_ROOT, env={**os.environ, **SERVER_ENV},
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        match = None
        with trio.fail_after(START_TIMEOUT_S):
            while match is None:
                assert proc.poll() is None, log_path.read_text(errors="replace")
                match = listening.search(log_path.read_text(errors="replace"))
                await trio.sleep(POLL_S)
        yield proc, int(match.group(1)), log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def wait_ready(http: httpx.AsyncClient) -> None:
    with trio.fail_after(START_TIMEOUT_S):
        while (await http.get("/ready")).status_code != 200:  # noqa: ASYNC110
            await trio.sleep(POLL_S)


def https(port: int, certificate: Certificate, *, http2: bool) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"https://127.0.0.1:{port}", http2=http2,
                             verify=certificate.client_context(("h2", "http/1.1")),
                             trust_env=False, timeout=WAIT_TIMEOUT_S)


async def alpn_of(port: int, certificate: Certificate, offered: list[str]) -> str | None:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, certificate.client_context(offered), server_hostname="localhost")
    await tls.do_handshake()
    chosen = tls.selected_alpn_protocol()
    await tls.aclose()
    return chosen


async def test_streamscope_serve_tls_offers_h2_and_http11_and_drains_with_goaway(
    tmp_path: Path, certificate: Certificate
) -> None:
    command = [STREAMSCOPE, "serve", "--bind", "127.0.0.1:0",
               "--certfile", str(certificate.cert), "--keyfile", str(certificate.key)]
    async with tls_process(tmp_path, command, _LISTENING) as (proc, port, log_path):
        async with https(port, certificate, http2=True) as h2, \
                https(port, certificate, http2=False) as h1:
            await wait_ready(h1)
            assert await alpn_of(port, certificate, ["h2", "http/1.1"]) == "h2"
            assert await alpn_of(port, certificate, ["http/1.1"]) == "http/1.1"
            body = stream_body(max_new_tokens=4, ignore_eos=True)
            over_h2 = await h2.post("/v1/stream", json=body)
            over_h1 = await h1.post("/v1/stream", json=body)
        assert (over_h2.http_version, over_h1.http_version) == ("HTTP/2", "HTTP/1.1")
        assert [e.event for e in parse_sse(over_h2.content)] == \
            [e.event for e in parse_sse(over_h1.content)] == ["start", *["token"] * 4, "done"]
        assert not (await plain_reply(port)).startswith(b"HTTP/")  # no plain HTTP on it

        idle = await H2Client.connect(("127.0.0.1", port), certificate)
        busy = await H2Client.connect(("127.0.0.1", port), certificate)
        running = await busy.post("/v1/stream", long_body())
        await busy.read_until(lambda: len(running.tokens()) >= 1)
        proc.send_signal(signal.SIGTERM)
        await idle.read_to_eof()
        await busy.read_to_eof()
        with trio.fail_after(WAIT_TIMEOUT_S):
            await proc.wait()

    assert idle.goaway is not None and idle.goaway.error_code == 0
    assert busy.goaway is not None and busy.goaway.error_code == 0
    assert running.events[-1].event in ("done", "error"), running.events[-1]
    if running.events[-1].event == "error":  # the drain's deadline came first
        assert '"shutdown"' in running.events[-1].data
    assert proc.returncode == 0, log_path.read_text(errors="replace")
    assert "draining (SIGTERM)" in log_path.read_text(errors="replace")


async def plain_reply(port: int) -> bytes:
    """What a TLS port answers a plain-HTTP request with (a TLS alert, or nothing)."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    await tcp.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    with trio.fail_after(WAIT_TIMEOUT_S):
        reply = await tcp.receive_some(65536)
    await tcp.aclose()
    return bytes(reply)


async def test_hypercorn_k_trio_with_a_certfile_serves_h2(
    tmp_path: Path, certificate: Certificate
) -> None:
    command = [sys.executable, "-m", "hypercorn", "-k", "trio", "--bind", "127.0.0.1:0",
               "--certfile", str(certificate.cert), "--keyfile", str(certificate.key),
               "app:app"]
    async with tls_process(tmp_path, command, _HYPERCORN_ON) as (proc, port, _):
        async with https(port, certificate, http2=True) as h2:
            await wait_ready(h2)
            answer = await h2.post("/v1/stream", json=stream_body(max_new_tokens=3))
        assert (answer.status_code, answer.http_version) == (200, "HTTP/2")
        assert parse_sse(answer.content)[-1].event == "done"
        proc.send_signal(signal.SIGTERM)  # to hypercorn's main process: it stops its worker
        with trio.fail_after(WAIT_TIMEOUT_S):
            await proc.wait()
        assert proc.returncode == 0

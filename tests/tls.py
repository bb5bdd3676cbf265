"""TLS for the tests: a throwaway self-signed certificate made by ``openssl`` at test time.

``make_certificate`` runs ``openssl req -x509`` for a certificate for ``localhost`` and
``127.0.0.1`` (nothing secret is committed); ``Certificate.client_context`` is a client's
TLS context that trusts it. The ``certificate`` fixture (``conftest.py``) makes one per
session; ``http_server.open_servers(..., certificate)`` serves the app over TLS with it.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificate:
    cert: Path
    key: Path

    def client_context(self, alpn: Sequence[str] = ("h2",)) -> ssl.SSLContext:
        """A client's TLS context that trusts this certificate and offers ``alpn``."""
        context = ssl.create_default_context(cafile=str(self.cert))
        context.set_alpn_protocols(list(alpn))
        return context


def make_certificate(directory: Path) -> Certificate:
    """A self-signed certificate (P-256, one day) for localhost and 127.0.0.1, by openssl."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    assert shutil.which("openssl"), "no openssl: apt-get install -y openssl"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60)
    return Certificate(cert, key)

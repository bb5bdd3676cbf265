"""The edge's patches installed in hypercorn, for the versions they are known for only.

The fixes of hypercorn's trio worker (``closing_server.ClosingTCPServer`` for HTTP/1,
``h2_protocol.GuardedH2Protocol`` for HTTP/2) override private methods of hypercorn 0.18
and h11 0.16, pinned in ``pyproject.toml`` (``tests/test_http_connection.py`` checks that
``SUPPORTED_VERSIONS`` agrees with the pins). ``install`` checks the installed versions
first and refuses others, patching nothing, rather than run fixes that may no longer fit.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import hypercorn.trio.run
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from . import h2_protocol
from .closing_server import ClosingTCPServer

# The versions the patches of private methods are known for: pyproject.toml's pins
# (tests/test_http_connection.py checks they agree). ``install`` refuses others.
SUPPORTED_VERSIONS = {"hypercorn": ">=0.18,<0.19", "h11": ">=0.16,<0.17"}


class UnsupportedVersion(RuntimeError):
    """hypercorn or h11 is installed in a version these fixes are not known for."""


def install() -> None:
    """Make hypercorn's trio worker (the CLI's ``-k trio`` and ``hypercorn.trio.serve``)
    build ``ClosingTCPServer``s: ``worker_serve`` looks ``TCPServer`` up when it runs;
    and ``h2_protocol.GuardedH2Protocol`` for HTTP/2 (``h2_protocol.install``). Idempotent.

    Raises:
        UnsupportedVersion: hypercorn or h11 is outside ``SUPPORTED_VERSIONS`` (the
            patches reach into their private methods); nothing was patched.
    """
    check_versions()
    hypercorn.trio.run.TCPServer = ClosingTCPServer  # type: ignore[misc]
    h2_protocol.install()  # and its HTTP/2 connections: floods bounded, GOAWAY on drain


def check_versions(installed: Callable[[str], str] | None = None) -> None:
    """Raise UnsupportedVersion, naming the supported range, unless every package of
    ``SUPPORTED_VERSIONS`` is installed within it (``installed(name)``: its version;
    default ``importlib.metadata.version``)."""
    version_of = installed or importlib.metadata.version
    for name, supported in SUPPORTED_VERSIONS.items():
        try:
            found = version_of(name)
            ok = SpecifierSet(supported).contains(Version(found), prereleases=True)
        except importlib.metadata.PackageNotFoundError:
            found, ok = "(no version: not installed as a distribution)", False
        except InvalidVersion:
            ok = False
        if not ok:
            raise UnsupportedVersion(
                f"{name} {found} is installed, but app/edge's fixes of hypercorn patch private "
                f"methods of hypercorn and h11 known for {name}{supported} only (the pins in "
                f"pyproject.toml): install '{name}{supported}', or check the fixes against "
                f"this {name} (tests/test_http_connection.py) and move the pins")

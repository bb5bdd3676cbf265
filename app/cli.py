"""``streamscope serve``: the app under hypercorn's Trio worker, with defaults for this job.

::

    streamscope serve                                 # http://127.0.0.1:8000
    streamscope serve --bind 0.0.0.0:8000 --bind [::]:8000 --config hypercorn.toml
    streamscope serve --certfile cert.pem --keyfile key.pem   # https://, h2 and http/1.1

The command reads its options and the ``STREAMSCOPE_*`` settings, builds the app with the
composition root (``factory.create_app``) and serves it with the edge's
``edge/serve.py``, whose docstring says what it serves and why its defaults differ
from hypercorn's (the listen backlog, the timeouts, TLS and HTTP/2, the drain on a
signal). It sits beside the root, not in ``app.edge``, so that the edge never imports
the root: the arrows go from here to both.

argparse, not a CLI library: one subcommand and four options, and no dependency to pin.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .edge.hypercorn_patches import UnsupportedVersion
from .edge.serve import (
    DEFAULT_BIND,
    ServeError,
    configure_logging,
    make_config,
    run_until_drained,
)
from .factory import create_app
from .request_log import install_json_logging
from .settings import Settings, SettingsError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="streamscope", description="Stream a language model's tokens over HTTP (SSE).")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser(
        "serve", help="serve the app (hypercorn's Trio worker, in this process)",
        description="Serve streamscope. Settings: the STREAMSCOPE_* environment variables "
        "(docs/settings.md). No --workers: one process holds one model.")
    serve_parser.add_argument(
        "--bind", action="append", metavar="HOST:PORT", default=[],
        help=f"an address to listen on (repeatable; default {DEFAULT_BIND}, or the config "
        "file's bind)")
    serve_parser.add_argument(
        "--config", type=Path, metavar="FILE",
        help="hypercorn settings, any of them: a TOML file, or Python if it ends in .py "
        "(hypercorn's Config.from_toml / from_pyfile); they override this command's defaults")
    serve_parser.add_argument(
        "--certfile", type=Path, metavar="FILE",
        help="serve TLS with this certificate (PEM; with --keyfile): ALPN offers h2 and "
        "http/1.1")
    serve_parser.add_argument(
        "--keyfile", type=Path, metavar="FILE", help="the certificate's private key (PEM)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``streamscope`` console script. Exit status: 0 after a drain, 2 when it
    cannot start as asked (a setting, an option, or a hypercorn or h11 outside the
    versions ``hypercorn_patches`` is known for)."""
    args = parse_args(argv)
    configure_logging()
    try:
        settings = Settings.from_env()
        if settings.log_format == "json":  # STREAMSCOPE_LOG_FORMAT: our lines as JSON
            install_json_logging()
        config = make_config(settings, args.config, args.bind, certfile=args.certfile,
                             keyfile=args.keyfile)
        app = create_app(settings)  # installs the HTTP fixes, which check the versions
    except (SettingsError, ServeError, UnsupportedVersion) as exc:
        print(f"streamscope serve: {exc}", file=sys.stderr)
        return 2
    run_until_drained(app, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())

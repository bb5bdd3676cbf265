"""``python -m tools.lab._serve serve [--bind ...]``: ``streamscope serve``
(``app/cli.py``) serving the lab's app (``_app.py``), with its ``STREAMSCOPE_LAB_*``
devices: the same arguments, defaults, signals and exit statuses.
"""

import os
import sys
from collections.abc import Sequence

from app.cli import parse_args
from app.edge.serve import ServeError, configure_logging, make_config, run_until_drained
from app.settings import Settings, SettingsError
from tools.lab._app import create_lab_app
from tools.lab._settings import LabSettingsError, split_lab_environ


def main(argv: Sequence[str] | None = None) -> int:
    """As ``app.cli.main``, with the lab's app. Exit status: 0 after a drain, 2 when
    it cannot start as asked."""
    args = parse_args(argv)
    configure_logging()
    try:
        lab_settings, service_environ = split_lab_environ(os.environ)
        settings = Settings.from_env(service_environ)
        config = make_config(settings, args.config, args.bind)
    except (LabSettingsError, SettingsError, ServeError) as exc:
        print(f"streamscope serve: {exc}", file=sys.stderr)
        return 2
    run_until_drained(create_lab_app(settings, lab_settings), config)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The lab server's settings: ``STREAMSCOPE_LAB_*`` variables, which the service refuses.

Imports nothing of ``app``: ``_asgi.py`` reads these and takes them out of the
environment before ``app`` reads the service's settings.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

LAB_PREFIX = "STREAMSCOPE_LAB_"
# Padding above this would make one token event larger than a whole ordinary answer
# many times over; the slowclient experiment uses 64 KiB.
MAX_PAD_BYTES = 1 << 20
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


class LabSettingsError(ValueError):
    """A ``STREAMSCOPE_LAB_*`` variable is unknown or invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class LabSettings:
    """The lab's devices; the defaults are the service's behaviour."""

    pad_bytes: int = 0  # STREAMSCOPE_LAB_PAD_BYTES: 0 (off), or 2 to MAX_PAD_BYTES
    detect_disconnect: bool = True  # STREAMSCOPE_LAB_DETECT_DISCONNECT

    def __post_init__(self) -> None:
        if not (self.pad_bytes == 0 or 2 <= self.pad_bytes <= MAX_PAD_BYTES):
            raise LabSettingsError(f"{LAB_PREFIX}PAD_BYTES must be 0 (off) or from 2 to "
                                   f"{MAX_PAD_BYTES}, not {self.pad_bytes!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> LabSettings:
        """Read the ``STREAMSCOPE_LAB_*`` variables; an empty value counts as unset.

        Raises:
            LabSettingsError: an unknown name (the message lists the known ones) or a bad
                value.
        """
        known = {f"{LAB_PREFIX}PAD_BYTES", f"{LAB_PREFIX}DETECT_DISCONNECT"}
        unknown = sorted(n for n in environ if n.startswith(LAB_PREFIX) and n not in known)
        if unknown:
            raise LabSettingsError(f"{', '.join(unknown)}: not a lab setting "
                                   f"(known: {', '.join(sorted(known))})")
        pad = environ.get(f"{LAB_PREFIX}PAD_BYTES", "").strip() or "0"
        detect = environ.get(f"{LAB_PREFIX}DETECT_DISCONNECT", "").strip().lower() or "true"
        if not pad.isdigit():
            raise LabSettingsError(f"{LAB_PREFIX}PAD_BYTES={pad!r}: expected a whole number")
        if detect not in _TRUE | _FALSE:
            raise LabSettingsError(
                f"{LAB_PREFIX}DETECT_DISCONNECT={detect!r}: expected true or false")
        return cls(pad_bytes=int(pad), detect_disconnect=detect in _TRUE)


def lab_padding(size: int) -> bytes:
    """Exactly ``size`` bytes (0, or at least 2) that SSE parsers ignore: one comment line
    ``:ppp...``, with no blank line after it, for the reason given in ``encode_comment``.
    """
    if size == 0:
        return b""
    if size < 2:
        raise ValueError(f"a comment line takes at least 2 bytes, not {size}")
    return b":" + b"p" * (size - 2) + b"\n"


def take_lab_settings(environ: MutableMapping[str, str]) -> LabSettings:
    """``LabSettings.from_env(environ)``, then delete the ``STREAMSCOPE_LAB_*`` names.

    Raises:
        LabSettingsError: as ``from_env``.
    """
    settings = LabSettings.from_env(environ)
    for name in [n for n in environ if n.startswith(LAB_PREFIX)]:
        del environ[name]
    return settings

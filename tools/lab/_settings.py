"""The lab server's settings: ``STREAMSCOPE_LAB_*`` variables, which the service refuses.

Imports nothing of ``app``. ``split_lab_environ`` parts an environment into these and the
rest, which the service's ``Settings.from_env`` then reads (``_asgi.py``, ``_serve.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

LAB_PREFIX = "STREAMSCOPE_LAB_"
# Padding above this would make one token event larger than a whole ordinary answer
# many times over; the slowclient experiment uses 64 KiB.
MAX_PAD_BYTES = 1 << 20
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})
# The engine's admission (on_demand, the service's) or the lab's reservation (reservation.py).
KV_ADMISSIONS = ("on_demand", "reserve")


class LabSettingsError(ValueError):
    """A ``STREAMSCOPE_LAB_*`` variable is unknown or invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class LabSettings:
    """The lab's devices; the defaults are the service's behaviour."""

    pad_bytes: int = 0  # STREAMSCOPE_LAB_PAD_BYTES: 0 (off), or 2 to MAX_PAD_BYTES
    detect_disconnect: bool = True  # STREAMSCOPE_LAB_DETECT_DISCONNECT
    kv_admission: str = "on_demand"  # STREAMSCOPE_LAB_KV_ADMISSION: one of KV_ADMISSIONS
    naive: bool = False  # STREAMSCOPE_LAB_NAIVE: the step loop waits for readers (naive.py)

    def __post_init__(self) -> None:
        if not (self.pad_bytes == 0 or 2 <= self.pad_bytes <= MAX_PAD_BYTES):
            raise LabSettingsError(f"{LAB_PREFIX}PAD_BYTES must be 0 (off) or from 2 to "
                                   f"{MAX_PAD_BYTES}, not {self.pad_bytes!r}")
        if self.kv_admission not in KV_ADMISSIONS:
            raise LabSettingsError(f"{LAB_PREFIX}KV_ADMISSION={self.kv_admission!r}: expected "
                                   f"{' or '.join(KV_ADMISSIONS)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> LabSettings:
        """Read the ``STREAMSCOPE_LAB_*`` variables; an empty value counts as unset.

        Raises:
            LabSettingsError: an unknown name (the message lists the known ones) or a bad
                value.
        """
        known = {f"{LAB_PREFIX}PAD_BYTES", f"{LAB_PREFIX}DETECT_DISCONNECT",
                 f"{LAB_PREFIX}KV_ADMISSION", f"{LAB_PREFIX}NAIVE"}
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
        admission = environ.get(f"{LAB_PREFIX}KV_ADMISSION", "").strip().lower() or "on_demand"
        naive = environ.get(f"{LAB_PREFIX}NAIVE", "").strip().lower() or "false"
        if naive not in _TRUE | _FALSE:
            raise LabSettingsError(f"{LAB_PREFIX}NAIVE={naive!r}: expected true or false")
        return cls(pad_bytes=int(pad), detect_disconnect=detect in _TRUE,
                   kv_admission=admission, naive=naive in _TRUE)


def lab_padding(size: int) -> bytes:
    """Exactly ``size`` bytes (0, or at least 2) that SSE parsers ignore: one comment line
    ``:ppp...``, with no blank line after it, for the reason given in ``encode_comment``.
    """
    if size == 0:
        return b""
    if size < 2:
        raise ValueError(f"a comment line takes at least 2 bytes, not {size}")
    return b":" + b"p" * (size - 2) + b"\n"


def split_lab_environ(environ: Mapping[str, str]) -> tuple[LabSettings, dict[str, str]]:
    """The lab's settings from ``environ``, and the rest of ``environ`` (what the service
    reads: it refuses the ``STREAMSCOPE_LAB_*`` names). ``environ`` is left as it is.

    Raises:
        LabSettingsError: as ``LabSettings.from_env``.
    """
    settings = LabSettings.from_env(environ)
    rest = {name: value for name, value in environ.items() if not name.startswith(LAB_PREFIX)}
    return settings, rest

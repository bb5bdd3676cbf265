"""Settings: every environment variable the server reads, read here and nowhere else.

``Settings.from_env()`` reads the ``STREAMSCOPE_*`` variables once, at ``create_app()``,
so that ``hypercorn -k trio app:app`` needs no arguments. A bad value, an inconsistent
pair, or an unknown ``STREAMSCOPE_`` name (a typo would otherwise be ignored silently)
fails at startup with one ``SettingsError`` that names every problem. An empty value
counts as unset. This module knows no Quart and no engine internals; it hands the hub
its part as a ``streams.HubSettings``.

The README's settings table is ``settings_table()``: each field's metadata says its
meaning, so the table and the code cannot drift apart.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from streams import HubSettings, PolicyName

ENV_PREFIX = "STREAMSCOPE_"
BUILTIN_MODELS = ("smollm2", "tiny-gpt2", "tiny-llama")


class SettingsError(ValueError):
    """One or more ``STREAMSCOPE_`` variables are invalid; the message names each one."""


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True, slots=True)
class Settings:
    """The server's configuration. Field ``name`` is read from ``STREAMSCOPE_NAME``.

    Raises:
        SettingsError: from the constructor, if a value is out of range.
    """

    model: str = field(default="smollm2", metadata=_doc(
        "smollm2 (embedded SmolLM2-135M), tiny-gpt2, tiny-llama (random, for tests) "
        "or a local transformers folder"))
    model_name: str | None = field(default=None, metadata={**_doc(
        "another name for the model on the OpenAI routes: /v1/models lists it after the "
        "model setting's value, and a request's `model` may be either (else 404 "
        "model_not_found); `*` accepts any `model`"), "shown": "(none)"})
    device: str | None = field(default=None, metadata=_doc(
        "cpu or cuda (cuda:N); unset: cuda if available, else cpu"))
    policy: PolicyName = field(default=PolicyName.PAUSE_DROP, metadata=_doc(
        "slow-reader policy: naive, unbounded, pause, drop or pause-drop"))
    request_policies: frozenset[PolicyName] = field(
        default=frozenset({PolicyName.PAUSE_DROP, PolicyName.DROP}), metadata=_doc(
            "the policies a request's `policy` field may pick, comma-separated (others get "
            "422): any but naive, which would let one client stall every stream"))
    max_batch: int = field(default=32, metadata=_doc(
        "most sequences running at once (batch slots)"))
    cache_blocks: int | None = field(default=None, metadata={**_doc(
        "KV-cache blocks, allocated once at startup; unset: as many as "
        "STREAMSCOPE_CACHE_MEMORY holds"), "shown": "(from memory)"})
    cache_memory: float | int = field(default=0.1, metadata=_doc(
        "the KV cache's memory when cache_blocks is unset: a share of the device's "
        "available memory at startup (a number with a point, up to 1.0; on a GPU, of what "
        "the model left free) or bytes (`2147483648`, `512MiB`, `2GiB`); a position takes "
        "layers × 2 × kv heads × head dim × dtype bytes (45 KiB for smollm2: 0.1 of 22 GB "
        "available holds 47,728 positions, where 512 blocks held 8,192), and the cache never "
        "exceeds max_batch × the model's context"))
    kv_admission: str = field(default="on_demand", metadata=_doc(
        "on_demand: a sequence takes cache blocks as it writes (admission needs its prompt's "
        "blocks and a 1% watermark), and when they run out the newest running sequence is "
        "preempted and later recomputed, with the same tokens; reserve: every block a "
        "request may need (prompt + max_new_tokens) at admission, kept for comparison"))
    block_size: int = field(default=16, metadata=_doc("token positions per cache block"))
    max_prefill_tokens: int = field(default=256, metadata=_doc(
        "prompt tokens prefilled per engine step, all in one forward pass; the rest wait "
        "a step and a longer prompt is prefilled in chunks over several steps, so a burst "
        "of arrivals or a long prompt does not stall the running streams"))
    max_step_ms: float | None = field(default=None, metadata={**_doc(
        "a step-time target in milliseconds: each engine step prefills only the prompt "
        "tokens that measured costs (calibrated at startup, then from every step) say fit "
        "beside its decode pass, within max_prefill_tokens; unset: max_prefill_tokens "
        "alone"), "shown": "(off)"})
    ttft_deadline_ms: float | None = field(default=None, metadata={**_doc(
        "a time-to-first-token deadline in milliseconds for requests that give no "
        "`deadline_ms`: one whose first token the engine estimates later is refused at "
        "once with 429 deadline_unmeetable (Retry-After, the estimate in the body); one "
        "still waiting at its deadline ends with error deadline_missed; unset: none"),
        "shown": "(off)"})
    max_waiting: int = field(default=256, metadata=_doc(
        "open streams still waiting for their first token; more are refused with 429"))
    queue_limit: int = field(default=32, metadata=_doc(
        "events queued for one reader before it counts as behind"))
    stall_timeout_s: float = field(default=10.0, metadata=_doc(
        "seconds a reader may stay behind before a dropping policy ends it (slow_client)"))
    keepalive_s: float = field(default=15.0, metadata=_doc(
        "an SSE comment goes out on a stream that has sent nothing for this long"))
    resume_grace_s: float = field(default=30.0, metadata=_doc(
        "how long a resumable stream whose reader left keeps generating, its events "
        "logged, for a reader to resume it (`GET /v1/stream/<id>`); then it is cancelled"))
    resume_max_bytes: int = field(default=64 * 1024 * 1024, metadata=_doc(
        "most bytes of event logs held for resumable streams without a reader, "
        "server-wide; a detached stream that would pass it ends with error "
        "resume_log_full"))
    resume_store: str | None = field(default=None, repr=False, metadata={**_doc(
        "where resumable streams' event logs live: unset, this process's memory; "
        "redis://host:port/db, a Redis that several replicas share, so that a stream "
        "resumes on any of them (see Several replicas)"), "shown": "(memory)"})
    owner_lease_s: float = field(default=3.0, metadata=_doc(
        "with resume_store: the lease of the replica generating a resumable stream, "
        "renewed every third of it; once it lapses (the replica died), a resume on "
        "another replica takes the stream over and continues it with the same tokens"))
    max_new_tokens_limit: int = field(default=1024, metadata=_doc(
        "the largest max_new_tokens a request may ask for (422 above)"))
    default_max_new_tokens: int = field(default=64, metadata=_doc(
        "max_new_tokens for a request that gives none"))
    max_body_bytes: int = field(default=64 * 1024, metadata=_doc(
        "largest request body, by Content-Length and as read (413 above)"))
    max_prompt_chars: int = field(default=32_768, metadata=_doc(
        "longest prompt in characters (422 above); the token budget is checked too"))
    api_key: str | None = field(default=None, repr=False, metadata={**_doc(
        "if set, every route but /health, /ready, /metrics and the page (/, /page.js) needs "
        "`Authorization: Bearer <key>` (401 without); visible ASCII characters"),
        "shown": "(off)"})
    shutdown_grace_s: float = field(default=5.0, metadata=_doc(
        "the drain deadline: after SIGTERM, how long open streams may finish before they "
        "get error shutdown; hypercorn's --graceful-timeout must be at least this + 1"))

    def __post_init__(self) -> None:
        problems = [p for p in _range_problems(self) if p]
        if problems:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every ``STREAMSCOPE_*`` variable of ``environ`` (default ``os.environ``).

        Raises:
            SettingsError: naming every unknown variable and every bad value.
        """
        env = os.environ if environ is None else environ
        known = {_env_name(f.name): f for f in fields(cls)}
        problems = [
            f"{name} is not a setting (known: {', '.join(sorted(known))})"
            for name in sorted(env)
            if name.startswith(ENV_PREFIX) and name not in known
        ]
        values: dict[str, Any] = {}
        for name, f in known.items():
            raw = env.get(name, "").strip()
            if not raw:
                continue
            try:
                values[f.name] = _PARSERS[f.name](raw)
            except ValueError as exc:
                problems.append(f"{name}={raw!r}: {exc}")
        if problems:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
        return cls(**values)

    def hub_settings(self) -> HubSettings:
        return HubSettings(
            policy=self.policy,
            queue_limit=self.queue_limit,
            stall_timeout_s=self.stall_timeout_s,
            max_waiting=self.max_waiting,
            shutdown_grace_s=self.shutdown_grace_s,
        )


def settings_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting, in declaration order."""
    defaults = Settings()
    rows = []
    for f in fields(Settings):
        shown = f.metadata.get("shown") or _show(getattr(defaults, f.name))
        rows.append((_env_name(f.name), shown, f.metadata["doc"]))
    return rows


# -- parsing and checking --------------------------------------------------------------


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _show(value: object) -> str:
    if value is None:
        return "(auto)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, frozenset):
        return ",".join(sorted(_show(v) for v in value))
    return str(getattr(value, "value", value))


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("expected a whole number") from None
    if value < 1:
        raise ValueError("expected a whole number >= 1")
    return value


def _positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError("expected a finite number of seconds > 0")
    return value


def _resume_store(raw: str) -> str:
    scheme = urlsplit(raw).scheme
    if scheme in ("redis", "rediss", "unix") and "://" in raw:
        return raw
    raise ValueError("expected redis://host:port/db (or rediss://, unix://)")


def _positive_ms(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of milliseconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError("expected a finite number of milliseconds > 0")
    return value


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


KV_ADMISSIONS = ("on_demand", "reserve")
_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _memory(raw: str) -> float | int:
    """A share of memory (``0.1``, with a point) or bytes (``2147483648``, ``512MiB``)."""
    number = raw.strip().rstrip("BbKkMmGgIi")
    unit = raw.strip()[len(number):].lower()
    try:
        if "." in number and not unit:
            share = float(number)
            if 0 < share <= 1:
                return share
        elif unit in _MEMORY_UNITS:
            size = int(float(number) * _MEMORY_UNITS[unit])
            if size >= 1:
                return size
    except ValueError:
        pass
    raise ValueError("expected a share of memory in (0, 1] such as 0.1, or bytes such as "
                     "2147483648, 512MiB or 2GiB")


def _cache_blocks(raw: str) -> int:
    """Like ``_positive_int``, for a setting that may stay unset (checked on its own)."""
    return _positive_int(raw)


def _is_memory(value: object) -> bool:
    if isinstance(value, float):
        return 0 < value <= 1
    return _is_positive_int(value)


def _kv_admission(raw: str) -> str:
    if raw.lower() in KV_ADMISSIONS:
        return raw.lower()
    raise ValueError(f"expected one of {', '.join(KV_ADMISSIONS)}")


def _boolean(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise ValueError("expected true or false")


def _policy(raw: str) -> PolicyName:
    try:
        return PolicyName(raw.lower())
    except ValueError:
        names = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"expected one of {names}") from None


def _request_policies(raw: str) -> frozenset[PolicyName]:
    return frozenset(_policy(name.strip()) for name in raw.split(",") if name.strip())


def _device(raw: str) -> str:
    lowered = raw.lower()
    if lowered == "cpu" or lowered == "cuda" or (
        lowered.startswith("cuda:") and lowered[5:].isdigit()
    ):
        return lowered
    raise ValueError("expected cpu, cuda or cuda:N")


# A model name is an identifier in JSON and in URLs: printable ASCII, no spaces.
MAX_MODEL_NAME_CHARS = 256


def _model_name(raw: str) -> str:
    if len(raw) <= MAX_MODEL_NAME_CHARS and all("!" <= c <= "~" for c in raw):
        return raw
    raise ValueError(f"expected printable ASCII without spaces, at most "
                     f"{MAX_MODEL_NAME_CHARS} characters, or *")


def _model(raw: str) -> str:
    if raw in BUILTIN_MODELS or Path(raw).is_dir():
        return raw
    raise ValueError(f"expected {', '.join(BUILTIN_MODELS)} or an existing folder")


_PARSERS: dict[str, Callable[[str], Any]] = {
    "model": _model,
    "model_name": _model_name,
    "device": _device,
    "policy": _policy,
    "request_policies": _request_policies,
    "stall_timeout_s": _positive_seconds,
    "keepalive_s": _positive_seconds,
    "resume_grace_s": _positive_seconds,
    "shutdown_grace_s": _positive_seconds,
    "max_step_ms": _positive_ms,
    "ttft_deadline_ms": _positive_ms,
    "resume_store": _resume_store,
    "owner_lease_s": _positive_seconds,
    "cache_blocks": _cache_blocks,
    "cache_memory": _memory,
    "kv_admission": _kv_admission,
    "api_key": str,  # checked in _range_problems, whose message does not repeat the key
    **{
        name: _positive_int
        for name in (
            "max_batch", "block_size", "max_prefill_tokens", "max_waiting",
            "queue_limit", "resume_max_bytes",
            "max_new_tokens_limit", "default_max_new_tokens", "max_body_bytes",
            "max_prompt_chars",
        )
    },
}


def _range_problems(s: Settings) -> list[str]:
    """Checks of the constructed value, also for Settings made in code (tests)."""
    ints = [name for name, parse in _PARSERS.items() if parse is _positive_int]
    seconds = [name for name, parse in _PARSERS.items() if parse is _positive_seconds]
    problems = [f"{_env_name(n)} must be a whole number >= 1, not {getattr(s, n)!r}"
                for n in ints if not _is_positive_int(getattr(s, n))]
    problems += [f"{_env_name(n)} must be finite and > 0, not {getattr(s, n)!r}"
                 for n in seconds if not _is_positive_seconds(getattr(s, n))]
    if s.cache_blocks is not None and not _is_positive_int(s.cache_blocks):
        problems.append(f"{_env_name('cache_blocks')} must be a whole number >= 1, "
                        f"not {s.cache_blocks!r}")
    if not _is_memory(s.cache_memory):
        problems.append(f"{_env_name('cache_memory')} must be a share in (0, 1] or bytes "
                        f">= 1, not {s.cache_memory!r}")
    if s.kv_admission not in KV_ADMISSIONS:
        problems.append(f"{_env_name('kv_admission')} must be one of "
                        f"{', '.join(KV_ADMISSIONS)}, not {s.kv_admission!r}")
    if not isinstance(s.policy, PolicyName):
        problems.append(f"{_env_name('policy')} must be a PolicyName, not {s.policy!r}")
    if PolicyName.NAIVE in s.request_policies:
        # naive makes the step loop wait for this stream's reader: one client that stops
        # reading would stall every stream. Only the operator may choose it, server-wide.
        problems.append(f"{_env_name('request_policies')} may not include naive")
    if s.model_name is not None:
        try:
            _model_name(s.model_name)
        except ValueError as exc:
            problems.append(f"{_env_name('model_name')}: {exc}")
    for name in ("max_step_ms", "ttft_deadline_ms"):
        value = getattr(s, name)
        if value is not None and not _is_positive_seconds(value):
            problems.append(f"{_env_name(name)} must be finite and > 0, not {value!r}")
    if s.api_key is not None and not _is_api_key(s.api_key):
        problems.append(f"{_env_name('api_key')} must be visible ASCII characters (no "
                        "spaces), at least one")
    if not problems and s.default_max_new_tokens > s.max_new_tokens_limit:
        problems.append(
            f"{_env_name('default_max_new_tokens')} ({s.default_max_new_tokens}) must not "
            f"exceed {_env_name('max_new_tokens_limit')} ({s.max_new_tokens_limit})"
        )
    return problems


def _is_api_key(value: object) -> bool:
    # What a bearer token may hold, and what arrives intact in an HTTP header.
    return isinstance(value, str) and value != "" and all("!" <= c <= "~" for c in value)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_positive_seconds(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )

"""The engine's settings: which model, on which device, in which precision, and how its
steps and cache are sized.

What the engine is made of, apart from how the service around it behaves
(``settings.py``, whose ``Settings`` extends this class: one model, one environment,
these fields first). Each is read by the engine's load (``app/runtime/loading.py``) and
nowhere else: the engine factory (``MakeEngine``, ``load_engine_from_settings``) takes
this type, so that it can read nothing of the service's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .settings_env import ENV_PREFIX, Milliseconds, PositiveInt
from .settings_env import setting as _setting

BUILTIN_MODELS = ("smollm2", "tiny-gpt2", "tiny-llama")
_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30}


class EngineSettings(BaseSettings):
    """The engine's part of the configuration (see the module docstring)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, frozen=True, extra="forbid",
        validate_default=False, hide_input_in_errors=True,
    )

    model: str = _setting("smollm2",
        "smollm2 (embedded SmolLM2-135M), tiny-gpt2, tiny-llama (random, for tests) "
        "or a local transformers folder")
    device: str | None = _setting(None,
        "cpu or cuda (cuda:N); unset: cuda if available, else cpu")
    start_cache: bool = _setting(True,
        "keep what a start computes in the user's cache directory ($XDG_CACHE_HOME/"
        "streamscope, else ~/.cache/streamscope) for later starts: the embedded model's "
        "weights, converted from its GGUF file to float32 at the first start, and with "
        "max_step_ms the step-cost calibration (reused when a check pass agrees with it); "
        "false: compute both at every start and keep nothing")
    max_batch: PositiveInt = _setting(32, "most sequences running at once (batch slots)")
    cache_blocks: PositiveInt | None = _setting(None,
        "KV-cache blocks, allocated once at startup; unset: as many as "
        "STREAMSCOPE_CACHE_MEMORY holds", shown="(from memory)")
    cache_memory: float | int = _setting(0.1,
        "the KV cache's memory when cache_blocks is unset: a share of the device's "
        "available memory at startup (a number with a point, up to 1.0; on a GPU, of what "
        "the model left free) or bytes (`2147483648`, `512MiB`, `2GiB`); a position takes "
        "layers × 2 × kv heads × head dim × dtype bytes (45 KiB for smollm2: 0.1 of 22 GB "
        "available holds 47,728 positions, where 512 blocks held 8,192), and the cache never "
        "exceeds max_batch × the model's context")
    block_size: PositiveInt = _setting(16, "token positions per cache block")
    max_prefill_tokens: PositiveInt = _setting(256,
        "prompt tokens prefilled per engine step, all in one forward pass; the rest wait "
        "a step and a longer prompt is prefilled in chunks over several steps, so a burst "
        "of arrivals or a long prompt does not stall the running streams")
    max_step_ms: Milliseconds | None = _setting(None,
        "a step-time target in milliseconds: each engine step prefills only the prompt "
        "tokens that measured costs (calibrated at startup, then from every step) say fit "
        "beside its decode pass, within max_prefill_tokens; unset: max_prefill_tokens "
        "alone", shown="(off)")
    prefix_cache: bool = _setting(True,
        "share the KV cache's full blocks between prompts that begin with the same tokens "
        "(a conversation's history, a common system prompt): a cached prefix is not "
        "prefilled again; unreferenced cached blocks are evicted least recently used first "
        "when blocks are needed; a request whose next block another's prefill is computing "
        "waits for it and shares it (a burst with one system prompt computes it once); "
        "false: every prompt is prefilled whole")
    # -- precision (issue 37): read by the engine's load, checked against the device there
    dtype: Literal["auto", "float32", "bfloat16", "int8", "int4"] = _setting("auto",
        "the weights' precision: float32, bfloat16 (the KV cache follows it: half the "
        "memory per position), int8 (int8 weights, bfloat16 compute; CPU only), int4 (the "
        "GGUF file's own 4-bit blocks, bfloat16 compute; CPU only; the fastest at one "
        "stream) or auto (int4 on a CPU with AMX, bfloat16 on another that computes it "
        "natively, else float32: engine.precision.default_precision says why); "
        "concurrent answers equal solo ones in each; one the device cannot run, or not "
        "exactly on this CPU, is refused at start. Speed and agreement with float32: "
        "docs/results.md")

    @field_validator("device", mode="before")
    @classmethod
    def _device_lowercase(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        if value in BUILTIN_MODELS or Path(value).is_dir():
            return value
        raise ValueError(f"expected {', '.join(BUILTIN_MODELS)} or an existing folder")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        if value is None or value in ("cpu", "cuda") or (
            value.startswith("cuda:") and value[5:].isdigit()
        ):
            return value
        raise ValueError("expected cpu, cuda or cuda:N")

    @field_validator("cache_memory", mode="before")
    @classmethod
    def _memory(cls, value: object) -> float | int:
        """A share of memory (``0.1``, with a point) or bytes (``2147483648``, ``512MiB``)."""
        if isinstance(value, str):
            number = value.strip().rstrip("BbKkMmGgIi")
            unit = value.strip()[len(number):].lower()
            try:
                if "." in number and not unit:
                    value = float(number)
                elif unit in _MEMORY_UNITS:
                    value = int(float(number) * _MEMORY_UNITS[unit])
            except ValueError:
                pass
        if isinstance(value, bool) or not (
            (isinstance(value, float) and 0 < value <= 1)
            or (isinstance(value, int) and value >= 1)
        ):
            raise ValueError("expected a share of memory in (0, 1] such as 0.1, or bytes such "
                             "as 2147483648, 512MiB or 2GiB")
        return value

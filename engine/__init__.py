"""The engine: a step-driven language model over a paged KV cache.

Importing this package root loads no torch and changes nothing in the environment:
it exposes the plain data types, errors and sampling limits that other packages may
use, and ``load_engine``, which imports the torch parts when it is called (and only
then switches the model hub offline: see ``offline``). Plain thread-safe Python; no
HTTP and no Trio here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ChatTemplateError as ChatTemplateError
from .errors import DoubleRelease as DoubleRelease
from .errors import DuplicateRequestId as DuplicateRequestId
from .errors import EmptyPrompt as EmptyPrompt
from .errors import EngineError as EngineError
from .errors import InvalidConstraint as InvalidConstraint
from .errors import InvalidMaxNewTokens as InvalidMaxNewTokens
from .errors import InvalidRequest as InvalidRequest
from .errors import InvalidSampling as InvalidSampling
from .errors import PrecisionError as PrecisionError
from .errors import PromptTooLong as PromptTooLong
from .errors import StepReentered as StepReentered
from .json_bounds import bounded as bounded_schema
from .types import Constraint as Constraint
from .types import ConstraintKind as ConstraintKind
from .types import EngineEvent as EngineEvent
from .types import EngineStatistics as EngineStatistics
from .types import FinishEvent as FinishEvent
from .types import FinishReason as FinishReason
from .types import GenerationRequest as GenerationRequest
from .types import SamplingParams as SamplingParams
from .types import TokenEvent as TokenEvent
from .types import TokenLogprobs as TokenLogprobs
from .validation import MAX_LOGIT_BIAS as MAX_LOGIT_BIAS
from .validation import MAX_LOGIT_BIAS_ENTRIES as MAX_LOGIT_BIAS_ENTRIES
from .validation import MAX_PENALTY as MAX_PENALTY
from .validation import MAX_SEED as MAX_SEED
from .validation import MAX_TEMPERATURE as MAX_TEMPERATURE
from .validation import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS
from .validation import MAX_TOP_P as MAX_TOP_P
from .validation import MIN_SEED as MIN_SEED
from .validation import MIN_TEMPERATURE as MIN_TEMPERATURE
from .validation import MIN_TOP_K as MIN_TOP_K
from .validation import MIN_TOP_P as MIN_TOP_P
from .validation import validate_request as validate_request
from .validation import validate_sampling as validate_sampling

if TYPE_CHECKING:
    from .engine import Engine


def load_engine(
    model: str = "smollm2",
    device: str | None = None,
    *,
    start_cache: bool = True,
    precision: str = "float32",
    **engine_options: Any,
) -> Engine:
    """Load a model by name or path and wrap it in an Engine (imports torch); what each
    phase of it took is the engine's ``start_phases_s`` (``startup``). ``start_cache``:
    keep what the start computes in the user's cache directory and reuse it, the
    embedded model's converted weights (``model.load_model``) and, with a step-time
    target, the calibration when a check agrees (``start_cache``, ``costs.calibrate``),
    and the linear layers' rows per call (``batch_invariance``).
    ``precision``: the weights' (``engine.precision``); ``PrecisionError`` if the
    device cannot run it."""
    from .startup import phase, recording

    with recording() as phases:
        with phase("import_torch"):
            import torch  # noqa: F401  # the first import of a start, timed as such
        from .engine import Engine
        from .model import converted_cache_dir, default_device, load_model
        from .start_cache import identity_of, reusing

        # The linear layers' calibration (``batch_invariance``) is kept like the step costs.
        with phase("import_transformers"):  # identity_of's import, then load_model's
            identity = identity_of(model, device or default_device(), engine_options.get(
                "block_size", 16)) if start_cache else {}
        with reusing(converted_cache_dir() if start_cache else None, identity):
            loaded = load_model(model, device, model_cache=start_cache, precision=precision)
        calibrates = start_cache and engine_options.get("max_step_ms") is not None
        identity = identity_of(model, str(loaded.device),
                               engine_options.get("block_size", 16)) if calibrates else {}
        if calibrates and loaded.precision != "float32":  # a step's cost depends on it
            identity["precision"] = loaded.precision
        with reusing(converted_cache_dir() if calibrates else None, identity), phase("engine"):
            built = Engine(loaded, **engine_options)
    built.start_phases_s = phases.rounded()
    return built


__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_PENALTY",
    "MAX_SEED",
    "MAX_TEMPERATURE",
    "MAX_TOP_LOGPROBS",
    "MAX_TOP_P",
    "MIN_SEED",
    "MIN_TEMPERATURE",
    "MIN_TOP_K",
    "MIN_TOP_P",
    "ChatTemplateError",
    "Constraint",
    "ConstraintKind",
    "DoubleRelease",
    "DuplicateRequestId",
    "EmptyPrompt",
    "EngineError",
    "EngineEvent",
    "EngineStatistics",
    "FinishEvent",
    "FinishReason",
    "GenerationRequest",
    "InvalidConstraint",
    "InvalidMaxNewTokens",
    "InvalidRequest",
    "InvalidSampling",
    "PrecisionError",
    "PromptTooLong",
    "SamplingParams",
    "StepReentered",
    "TokenEvent",
    "TokenLogprobs",
    "bounded_schema",
    "load_engine",
    "validate_request",
    "validate_sampling",
]

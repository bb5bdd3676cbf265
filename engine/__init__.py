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
from .errors import InvalidMaxNewTokens as InvalidMaxNewTokens
from .errors import InvalidRequest as InvalidRequest
from .errors import InvalidSampling as InvalidSampling
from .errors import PromptTooLong as PromptTooLong
from .errors import StepReentered as StepReentered
from .types import EngineEvent as EngineEvent
from .types import EngineStatistics as EngineStatistics
from .types import FinishEvent as FinishEvent
from .types import FinishReason as FinishReason
from .types import GenerationRequest as GenerationRequest
from .types import SamplingParams as SamplingParams
from .types import TokenEvent as TokenEvent
from .validation import MAX_SEED as MAX_SEED
from .validation import MAX_TEMPERATURE as MAX_TEMPERATURE
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
    **engine_options: Any,
) -> Engine:
    """Load a model by name or path and wrap it in an Engine (imports torch)."""
    from .engine import Engine
    from .model import load_model

    loaded = load_model(model, device)
    return Engine(loaded, **engine_options)


__all__ = [
    "MAX_SEED",
    "MAX_TEMPERATURE",
    "MAX_TOP_P",
    "MIN_SEED",
    "MIN_TEMPERATURE",
    "MIN_TOP_K",
    "MIN_TOP_P",
    "ChatTemplateError",
    "DoubleRelease",
    "DuplicateRequestId",
    "EmptyPrompt",
    "EngineError",
    "EngineEvent",
    "EngineStatistics",
    "FinishEvent",
    "FinishReason",
    "GenerationRequest",
    "InvalidMaxNewTokens",
    "InvalidRequest",
    "InvalidSampling",
    "PromptTooLong",
    "SamplingParams",
    "StepReentered",
    "TokenEvent",
    "load_engine",
    "validate_request",
    "validate_sampling",
]

"""The engine: a step-driven language model over a paged KV cache.

Importing this package root loads no torch: it exposes the plain data types and
errors that other packages may use, and ``load_engine`` which imports the torch
parts when it is called. Plain thread-safe Python; no HTTP and no Trio here.
"""

from __future__ import annotations

import os

# No model hub at run time, ever: set before anything imports huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

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
]

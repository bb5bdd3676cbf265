"""The request body of ``/v1/stream`` and ``/v1/generate``, validated by pydantic.

Owns the JSON shape a client may send and every check that needs no engine: types
(strict: ``"5"`` is not a number, ``true`` is not an integer), unknown fields (refused),
ranges, and the server's limits (``RequestLimits``, from settings, passed as the
validation context). What only the engine can tell (the prompt's token count against
the cache and the model's context) is checked by ``engine.submit``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from engine import GenerationRequest, SamplingParams
from streams import PolicyName

if TYPE_CHECKING:
    from .settings import Settings

# Stop strings are matched against every token's text; a few short ones cover real use
# (OpenAI allows 4) and keep the matcher's per-token work small.
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
# The engine's own ranges (engine/sampling.py validate); checked here too so a bad
# value is a 422 with the field's name before anything reaches the engine.
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1
# The longest TTFT deadline a request may give: ten minutes is already no deadline.
MAX_DEADLINE_MS = 600_000.0


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The server's limits on one request, from settings."""

    max_prompt_chars: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    # The policies a request may pick (STREAMSCOPE_REQUEST_POLICIES); never naive.
    request_policies: frozenset[PolicyName]

    @classmethod
    def from_settings(cls, settings: Settings) -> RequestLimits:
        return cls(
            max_prompt_chars=settings.max_prompt_chars,
            max_new_tokens_limit=settings.max_new_tokens_limit,
            default_max_new_tokens=settings.default_max_new_tokens,
            request_policies=settings.request_policies,
        )


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class GenerateBody(BaseModel):
    """``{"prompt", "max_new_tokens", "stop", "temperature", "top_p", "top_k", "seed",
    "ignore_eos", "policy", "resumable", "deadline_ms"}``; only ``prompt`` is required.

    Validate with ``parse_generate_body`` (the limits are its context).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str = Field(min_length=1)
    max_new_tokens: int | None = Field(default=None, ge=1, validate_default=True)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    ignore_eos: bool = False
    policy: PolicyName | None = None  # the slow-reader policy for this stream only
    resumable: bool = False  # /v1/stream: ids <request_id>:<n>, resumable (resumable.py)
    # The first token is due this long after the request arrived, or it is refused
    # (429 deadline_unmeetable) or let go (deadline_missed); None: the server's default.
    deadline_ms: float | None = Field(default=None, gt=0.0, le=MAX_DEADLINE_MS,
                                      allow_inf_nan=False)

    @field_validator("prompt")
    @classmethod
    def _prompt_within_limit(cls, value: str, info: ValidationInfo) -> str:
        limit = _limits(info).max_prompt_chars
        if len(value) > limit:
            raise PydanticCustomError(
                "over_limit",
                "the prompt has {length} characters, over the limit of {limit}",
                {"length": len(value), "limit": limit},
            )
        return value

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens_within_limit(cls, value: int | None, info: ValidationInfo) -> int:
        limits = _limits(info)
        if value is None:
            return limits.default_max_new_tokens
        if value > limits.max_new_tokens_limit:
            raise PydanticCustomError(
                "over_limit", "must be at most {limit}", {"limit": limits.max_new_tokens_limit}
            )
        return value

    @field_validator("policy")
    @classmethod
    def _policy_allowed(cls, value: PolicyName | None, info: ValidationInfo) -> PolicyName | None:
        allowed = _limits(info).request_policies
        if value is not None and value not in allowed:
            raise PydanticCustomError(
                "policy_not_allowed",
                "this server lets a request pick only {allowed}",
                {"allowed": ", ".join(sorted(p.value for p in allowed)) or "no policy"},
            )
        return value

    def to_generation_request(self, ttft_deadline: float | None = None) -> GenerationRequest:
        """The engine's request, under a fresh id (which the client sees as ``id``);
        ``ttft_deadline``: see ``serving.ttft_deadline``."""
        assert self.max_new_tokens is not None  # the validator filled in the default
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt=self.prompt,
            max_new_tokens=self.max_new_tokens,
            stop=tuple(self.stop),
            sampling=SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                ignore_eos=self.ignore_eos,
            ),
            ttft_deadline=ttft_deadline,
        )


def parse_generate_body(raw: bytes, limits: RequestLimits) -> GenerateBody:
    """Parse and validate a request body.

    Raises:
        pydantic.ValidationError: the body is not JSON (type ``json_invalid``), not an
            object, or a field is missing, unknown, mistyped or out of range.
    """
    return GenerateBody.model_validate_json(raw, context=limits)


def _limits(info: ValidationInfo) -> RequestLimits:
    if not isinstance(info.context, RequestLimits):
        raise TypeError("validate a GenerateBody with parse_generate_body(raw, limits)")
    return info.context

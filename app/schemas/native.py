"""The request body of ``/v1/stream`` and ``/v1/generate``, validated by pydantic.

Owns the JSON shape a client may send and every check that needs no engine: types
(strict: ``"5"`` is not a number, ``true`` is not an integer), unknown fields (refused),
ranges, and the server's limits (``RequestLimits``, from settings, passed as the
validation context; the limits themselves are in ``limits.py``). What only the engine
can tell (the prompt's token count against the cache and the model's context) is
checked by ``engine.submit``.
"""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from engine import MAX_TOP_LOGPROBS, MIN_TOP_K, GenerationRequest, SamplingParams
from streams import PolicyName

from ..new_tokens import UNTIL_CONTEXT
from ..priority_bands import DEFAULT_BAND, Priority
from .constraint import ConstraintBody, check_constraint_size
from .limits import (
    CacheSalt,
    DeadlineMs,
    NewTokens,
    Prompt,
    RequestLimits,
    Seed,
    StopStrings,
    Temperature,
    TopP,
    check_new_tokens,
    check_prompt_chars,
    check_top_logprobs,
    limits_of,
    salt_bytes,
)
from .penalties import LogitBias, Penalty, RepetitionPenalty, bias_pairs

_HOW = "validate a GenerateBody with parse_generate_body(raw, limits)"


class GenerateBody(BaseModel):
    """``{"prompt", "max_new_tokens", "stop", "temperature", "top_p", "top_k", "seed",
    "ignore_eos", "logprobs", "top_logprobs", "policy", "resumable", "deadline_ms",
    "cache_salt", "constraint", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias"}``; only ``prompt`` is required. With ``logprobs`` every
    ``token`` event carries the token's log-probability, and the likeliest
    ``top_logprobs`` (0 to 20) tokens'. ``constraint``: the form the output must take
    (``constraint.py``). The penalties and ``logit_bias`` (``penalties.py``): vLLM's
    ``repetition_penalty`` (> 0, 1 changes nothing), and OpenAI's others.

    Validate with ``parse_generate_body`` (the limits are its context).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: Prompt
    max_new_tokens: NewTokens | None = Field(default=None, validate_default=True)
    stop: StopStrings = Field(default_factory=list)
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: int = Field(default=0, ge=MIN_TOP_K)
    seed: Seed | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    policy: PolicyName | None = None  # the slow-reader policy for this stream only
    resumable: bool = False  # /v1/stream: ids <request_id>:<n>, resumable
    deadline_ms: DeadlineMs | None = None  # None: the server's default
    cache_salt: CacheSalt | None = None  # splits the key's prefix cache (docs/security.md)
    constraint: ConstraintBody | None = None  # the output's form: see constraint.py
    # The logits' changes (penalties.py): vLLM's repetition_penalty, OpenAI's others.
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    # Its band (vLLM's priority: lower is sooner): served no higher than its key's
    # ceiling (app/priority_bands.py); None: the gateway's objective, or the default.
    priority: Priority | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_within_limit(cls, value: str, info: ValidationInfo) -> str:
        check_prompt_chars(len(value), limits_of(info, _HOW))
        return value

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens_within_limit(cls, value: int | None, info: ValidationInfo) -> int:
        limits = limits_of(info, _HOW)
        if value is None:
            return UNTIL_CONTEXT  # Runtime.prepare fills it in (app/new_tokens.py)
        check_new_tokens(value, limits)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int, info: ValidationInfo) -> int:
        check_top_logprobs(value, info.data.get("logprobs"))
        return value

    @field_validator("constraint")
    @classmethod
    def _constraint_within_limit(cls, value: ConstraintBody | None,
                                 info: ValidationInfo) -> ConstraintBody | None:
        if value is not None:
            check_constraint_size(value.to_constraint(),
                                  limits_of(info, _HOW).max_constraint_chars)
        return value

    @field_validator("policy")
    @classmethod
    def _policy_allowed(cls, value: PolicyName | None, info: ValidationInfo) -> PolicyName | None:
        allowed = limits_of(info, _HOW).request_policies
        if value is not None and value not in allowed:
            raise PydanticCustomError(
                "policy_not_allowed",
                "this server lets a request pick only {allowed}",
                {"allowed": ", ".join(sorted(p.value for p in allowed)) or "no policy"},
            )
        return value

    def generation_request(
        self, prompt: str | None = None, prompt_ids: tuple[int, ...] | None = None, *,
        ttft_deadline: float | None = None,
    ) -> GenerationRequest:
        """The engine's request, under a fresh id (which the client sees as ``id``), for
        ``prompt`` (None: the body's own) and its ids if already encoded; ``ttft_deadline``:
        see ``serving.ttft_deadline``. (Every body's builder has this name and shape.)"""
        assert self.max_new_tokens is not None  # the validator filled in the default
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt=self.prompt if prompt is None else prompt,
            max_new_tokens=self.max_new_tokens,
            stop=tuple(self.stop),
            sampling=SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                ignore_eos=self.ignore_eos,
                logprobs=self.logprobs,
                top_logprobs=self.top_logprobs,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=bias_pairs(self.logit_bias),
            ),
            prompt_token_ids=prompt_ids,
            ttft_deadline=ttft_deadline,
            cache_namespace=salt_bytes(self.cache_salt),
            constraint=None if self.constraint is None else self.constraint.to_constraint(),
            priority=DEFAULT_BAND if self.priority is None else self.priority,
        )

    @property
    def asked_band(self) -> int | None:
        """The band it asks for (``priority_bands.asked_band``); None: none."""
        return self.priority


def parse_generate_body(raw: bytes, limits: RequestLimits) -> GenerateBody:
    """Parse and validate a request body.

    Raises:
        pydantic.ValidationError: the body is not JSON (type ``json_invalid``), not an
            object, or a field is missing, unknown, mistyped or out of range.
    """
    return GenerateBody.model_validate_json(raw, context=limits)

"""``POST /v1/completions``: the OpenAI-compatible completions protocol.

vLLM, llama.cpp's server and ``transformers serve`` speak it, and so do many
clients and load generators; serving it lets those clients use streamscope and
lets ``tools.load --protocol openai`` measure us and a peer the same way. It
runs on the same hub, streams and disconnect path as ``/v1/stream``; only the
JSON on the wire differs:

* ``"stream": false``: one ``text_completion`` object with ``choices[0].text``
  and ``usage``;
* ``"stream": true``: one ``data:`` chunk per token (``choices[0].text`` is the
  delta, ``finish_reason`` null), a last chunk with the finish reason, then
  ``data: [DONE]``. A failure after the first byte is a ``data:`` chunk holding
  our error envelope, and the stream ends without ``[DONE]``.

Fields we do not implement (``n`` > 1, ``logprobs``, ``echo``, ``best_of``,
``suffix``) are refused with a 422; other unknown fields are ignored, as OpenAI
clients send many. Defaults follow OpenAI (``max_tokens`` 16, ``temperature`` 1).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine import FinishEvent, FinishReason, GenerationRequest, TokenEvent
from streams import StreamError, StreamItem, encode_event

from .schemas import MAX_SEED, MAX_TEMPERATURE, GenerateBody, RequestLimits, StopString
from .sse_body import EventStreamBody

if TYPE_CHECKING:
    from .metrics import RequestTimer

OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for completions
DONE = encode_event("[DONE]")

# eos and stop strings are both "stop" in OpenAI's vocabulary.
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}


class CompletionsBody(BaseModel):
    """The subset of OpenAI's completions request that the engine can honour."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    model: str = ""
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=OPENAI_DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: StopString | list[StopString] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    n: Literal[1] = 1
    logprobs: None = None
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("max_tokens")
    @classmethod
    def _within_limit(cls, value: int, info: ValidationInfo) -> int:
        assert isinstance(info.context, RequestLimits)
        if value > info.context.max_new_tokens_limit:
            raise ValueError(f"must be at most {info.context.max_new_tokens_limit}")
        return value

    def to_generation_request(self, limits: RequestLimits) -> GenerationRequest:
        """The same request as our own body would make (so the same checks apply)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        ours = GenerateBody.model_validate(
            {
                "prompt": self.prompt,
                "max_new_tokens": self.max_tokens,
                "stop": stops,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "seed": self.seed,
            },
            context=limits,
        )
        return ours.to_generation_request()


def parse_completions_body(raw: bytes, limits: RequestLimits) -> CompletionsBody:
    """Raises pydantic.ValidationError, answered as 422 like our own body's."""
    return CompletionsBody.model_validate_json(raw, context=limits)


def completion_object(
    request_id: str, model: str, text: str, finish: FinishEvent
) -> dict[str, Any]:
    """The whole answer of a ``"stream": false`` request."""
    return {
        **_header(request_id, model),
        "choices": [_choice(text, FINISH_REASONS[finish.reason])],
        "usage": {
            "prompt_tokens": finish.prompt_tokens,
            "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        },
    }


class CompletionChunksBody(EventStreamBody):
    """``/v1/stream``'s body with OpenAI's chunks on the wire instead of our events."""

    def __init__(
        self, stream: Any, *, keepalive_s: float, model: str, timer: RequestTimer | None = None
    ) -> None:
        super().__init__(stream, keepalive_s=keepalive_s, timer=timer)
        self.model = model

    def _opening(self) -> bytes:
        return b""  # OpenAI's stream has no start event

    def _encode(self, item: StreamItem) -> bytes:
        match item:
            case TokenEvent():
                return self._chunk(item.text, None)
            case FinishEvent():
                self.is_finished = True
                return self._chunk("", FINISH_REASONS[item.reason]) + DONE
            case StreamError():
                self.is_finished = True
                return self._error(item.type, item.message)
        raise TypeError(f"not a stream item: {item!r}")

    def _error(self, error_type: str, message: str) -> bytes:
        return _data({"error": {"type": error_type, "message": message}})

    def _chunk(self, text: str, finish_reason: str | None) -> bytes:
        return _data(
            {
                **_header(self.stream.request_id, self.model),
                "choices": [_choice(text, finish_reason)],
            }
        )


def _header(request_id: str, model: str) -> dict[str, Any]:
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }


def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _data(payload: dict[str, Any]) -> bytes:
    return encode_event(json.dumps(payload, ensure_ascii=True, separators=(",", ":")))

"""The OpenAI-compatible answers' shapes: one per route, for whole answers and chunks.

vLLM, llama.cpp's server and ``transformers serve`` speak this protocol, and so do the
official SDKs and many load generators. Only the JSON differs between the routes:

* a whole answer: one ``text_completion`` (``choices[0].text``) or ``chat.completion``
  (``choices[0].message``, role ``assistant``) with ``finish_reason`` and ``usage``
  (``whole_answer``);
* a stream (``openai_chunks.py``): chat opens with a chunk whose delta is
  ``{"role": "assistant", "content": ""}``; then one chunk per token (the text delta,
  ``finish_reason`` null) and a last chunk with the finish reason.

Pure data shaping: no I/O, so the routes and the chunk encoder share it.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from engine import FinishEvent, FinishReason

# eos and stop strings are both "stop" in OpenAI's vocabulary.
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}


class ChoiceShape(Protocol):
    """How one route writes its answers and chunks."""

    object_name: str  # the whole answer's "object"
    chunk_object_name: str  # each chunk's "object"
    id_prefix: str

    def whole_choice(self, text: str, finish_reason: str) -> dict[str, Any]: ...
    def first_choice(self) -> dict[str, Any] | None:
        """The choice of a chunk sent before any token, or None for no such chunk."""
        ...

    def delta_choice(self, text: str) -> dict[str, Any]: ...
    def last_choice(self, finish_reason: str) -> dict[str, Any]: ...


class CompletionShape:
    """``/v1/completions``: text choices, no opening chunk."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def whole_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def first_choice(self) -> dict[str, Any] | None:
        return None

    def delta_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}

    def last_choice(self, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}


class ChatShape:
    """``/v1/chat/completions``: an assistant message, or deltas after a role chunk."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def whole_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": 0, "message": message, "logprobs": None,
                "finish_reason": finish_reason}

    def first_choice(self) -> dict[str, Any] | None:
        return self._delta({"role": "assistant", "content": ""}, None)

    def delta_choice(self, text: str) -> dict[str, Any]:
        return self._delta({"content": text}, None)

    def last_choice(self, finish_reason: str) -> dict[str, Any]:
        return self._delta({}, finish_reason)

    @staticmethod
    def _delta(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


COMPLETION = CompletionShape()
CHAT = ChatShape()


def whole_answer(
    shape: ChoiceShape, request_id: str, model: str, text: str, finish: FinishEvent
) -> dict[str, Any]:
    """The answer of a request without ``"stream": true``."""
    return {
        "id": shape.id_prefix + request_id,
        "object": shape.object_name,
        "created": int(time.time()),
        "model": model,
        "choices": [shape.whole_choice(text, FINISH_REASONS[finish.reason])],
        "usage": usage(finish),
    }


def usage(finish: FinishEvent) -> dict[str, int]:
    """The token counts of a finished request, as OpenAI reports them."""
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }

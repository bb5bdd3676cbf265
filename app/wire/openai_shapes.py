"""The OpenAI-compatible answers' shapes: one per route, for whole answers and chunks.

vLLM, llama.cpp's server and ``transformers serve`` speak this protocol, and so do the
official SDKs and many load generators. Only the JSON differs between the routes:

* a whole answer: one ``text_completion`` (``choices[0].text``) or ``chat.completion``
  (``choices[0].message``, role ``assistant``) with ``finish_reason`` and ``usage``
  (``whole_answer``);
* a stream (``openai_chunks.py``): chat opens with a chunk whose delta is
  ``{"role": "assistant", "content": ""}``; then one chunk per token (the text delta,
  ``finish_reason`` null) and a last chunk with the finish reason.

Log-probabilities (a request that asked: its tokens carry ``TokenLogprobs``), in the
shapes the SDK parses, a token's entries the same in a whole answer and in its chunk:

* chat: ``logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}], "refusal": null}``, ``bytes`` the token's
  text as UTF-8 (a token that holds part of a character is U+FFFD there, as vLLM has it);
* completions: ``logprobs: {"tokens", "token_logprobs", "top_logprobs" (a dict per
  token, text to logprob: the likeliest and the chosen one), "text_offset"}``, the
  offset of each token's text in the answer's text (where its delta begins).

Pure data shaping: no I/O, so the routes and the chunk encoder share it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from engine import FinishEvent, FinishReason, TokenEvent

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

    def whole_choice(
        self, text: str, finish_reason: str, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]: ...
    def first_choice(self) -> dict[str, Any] | None:
        """The choice of a chunk sent before any token, or None for no such chunk."""
        ...

    def delta_choice(self, text: str, logprobs: dict[str, Any] | None = None
                     ) -> dict[str, Any]: ...
    def last_choice(self, finish_reason: str) -> dict[str, Any]: ...
    def logprobs(self, tokens: Sequence[TokenEvent], text_offset: int = 0
                 ) -> dict[str, Any] | None:
        """A choice's ``logprobs`` for ``tokens`` (None if none carries any);
        ``text_offset``: the characters of the answer before the first one's text."""
        ...


class CompletionShape:
    """``/v1/completions``: text choices, no opening chunk."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def whole_choice(
        self, text: str, finish_reason: str, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def first_choice(self) -> dict[str, Any] | None:
        return None

    def delta_choice(self, text: str, logprobs: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}

    def last_choice(self, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}

    def logprobs(self, tokens: Sequence[TokenEvent], text_offset: int = 0
                 ) -> dict[str, Any] | None:
        texts: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for token in tokens:
            lp = token.logprobs
            if lp is not None:
                top: dict[str, float] = {}
                for _, text, value in (*lp.top, (token.token_id, lp.token, lp.logprob)):
                    top.setdefault(text, value)  # two tokens of one text: the likelier
                texts.append(lp.token)
                values.append(lp.logprob)
                tops.append(top)
                offsets.append(text_offset)
            text_offset += len(token.text)
        if not texts:
            return None
        return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


class ChatShape:
    """``/v1/chat/completions``: an assistant message, or deltas after a role chunk."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def whole_choice(
        self, text: str, finish_reason: str, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": 0, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def first_choice(self) -> dict[str, Any] | None:
        return self._delta({"role": "assistant", "content": ""}, None)

    def delta_choice(self, text: str, logprobs: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
        return self._delta({"content": text}, None, logprobs)

    def last_choice(self, finish_reason: str) -> dict[str, Any]:
        return self._delta({}, finish_reason)

    def logprobs(self, tokens: Sequence[TokenEvent], text_offset: int = 0
                 ) -> dict[str, Any] | None:
        content = [
            {**_chat_entry(lp.token, lp.logprob),
             "top_logprobs": [_chat_entry(text, value) for _, text, value in lp.top]}
            for lp in (t.logprobs for t in tokens) if lp is not None
        ]
        return {"content": content, "refusal": None} if content else None

    @staticmethod
    def _delta(delta: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


COMPLETION = CompletionShape()
CHAT = ChatShape()


def whole_answer(
    shape: ChoiceShape, request_id: str, model: str, text: str, finish: FinishEvent,
    tokens: Sequence[TokenEvent] = (),
) -> dict[str, Any]:
    """The answer of a request without ``"stream": true``; ``tokens``, its token events,
    give its log-probabilities (if they carry any)."""
    choice = shape.whole_choice(text, FINISH_REASONS[finish.reason], shape.logprobs(tokens))
    return {
        "id": shape.id_prefix + request_id,
        "object": shape.object_name,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(finish),
    }


def usage(finish: FinishEvent) -> dict[str, Any]:
    """The token counts of a finished request, as OpenAI reports them: ``cached_tokens``
    are the prompt's tokens found in the prefix cache (in the key's own namespace), a
    part of ``prompt_tokens``."""
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
    }

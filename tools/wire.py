"""The wire protocols the load generator speaks: how to ask for a stream, how to read it.

Protocols. ``streamscope``: ``POST /v1/stream``, events start/token/done/error (unknown
events are ignored, as a tolerant reader should). ``openai``: the streaming completions
protocol that vLLM, llama.cpp's server and ``transformers serve`` speak, ``POST
/v1/completions`` with ``{"model", "prompt", "max_tokens", "temperature": 0, "stream":
true, "stream_options": {"include_usage": true}}`` (``model`` only when given;
``"ignore_eos": true`` when asked, an extension vLLM and llama.cpp accept), answered with
``data: {chunk}`` events until ``data: [DONE]``. ``include_usage`` is how OpenAI's API asks
for the closing ``usage`` chunk; ``transformers serve`` sends it only when asked (5.25 on).
``transformers``: ``openai`` for ``transformers serve``, which refuses ``ignore_eos`` (see
``TransformersServeWire``). ``llama``: ``openai`` for llama.cpp's ``llama-server``, with
``"cache_prompt": false`` (see ``LlamaServerWire``).
Caveat: that protocol has no token ids and no event per token, so a token here is a
chunk: one that carries text,
or empty text without a finish reason (a token whose bytes are held back). A closing
chunk with only a finish reason is not counted. A server that puts several tokens in one
chunk is under-counted and its gaps look longer; when it sends ``usage``, the record
keeps it so the two counts can be compared.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Protocol

from streams import ServerSentEvent
from tools.records import StreamRecord, StreamRequest


class WireProtocol(Protocol):
    name: str
    path: str  # the streaming endpoint
    warm_path: str  # a cheap GET that opens the connection before the barrier

    def body(self, request: StreamRequest, model: str | None) -> dict[str, Any]: ...

    def on_event(self, record: StreamRecord, event: ServerSentEvent, now: float) -> int:
        """Apply one event to ``record``; return the number of tokens it added."""
        ...


class StreamscopeWire:
    name = "streamscope"
    path = "/v1/stream"
    warm_path = "/health"

    def body(self, request: StreamRequest, model: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": request.prompt,
            "max_new_tokens": request.max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": request.ignore_eos,
        }
        if request.resumable:
            body["resumable"] = True
        return body

    def on_event(self, record: StreamRecord, event: ServerSentEvent, now: float) -> int:
        if event.event not in ("start", "token", "done", "error"):
            return 0  # a new event type: tolerated, as the protocol asks of clients
        data = json.loads(event.data)
        if event.event == "token":
            record.add_token(data["id"], data["text"], now)
            return 1
        if event.event == "start":
            record.request_id, record.prompt_tokens = data["id"], data["prompt_tokens"]
        elif event.event == "done":
            record.finish_reason, record.usage = data["finish_reason"], data["usage"]
            record.finished_at = now
        else:
            record.error = f"{data['error']['type']}: {data['error']['message']}"
            record.finished_at = now
        return 0


class OpenAIWire:
    name = "openai"
    path = "/v1/completions"
    warm_path = "/v1/models"

    def body(self, request: StreamRequest, model: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": request.prompt,
            "max_tokens": request.max_new_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:  # else the server's own (streamscope and vLLM accept a body without one)
            body["model"] = model
        if request.ignore_eos:
            body["ignore_eos"] = True
        return body

    def on_event(self, record: StreamRecord, event: ServerSentEvent, now: float) -> int:
        if event.data.strip() == "[DONE]":
            if record.finished_at is None:
                record.finished_at = now
            return 0
        chunk = json.loads(event.data)
        if "error" in chunk:
            record.error = json.dumps(chunk["error"])[:300]
            record.finished_at = now
            return 0
        if chunk.get("usage"):
            record.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return 0
        text, reason = choices[0].get("text") or "", choices[0].get("finish_reason")
        if reason:
            record.finish_reason = reason
        if text or not reason:  # see the module docstring's caveat
            record.add_token(None, text, now)
            return 1
        return 0


class TransformersServeWire(OpenAIWire):
    """``openai`` for ``transformers serve``: it refuses unknown fields (422), so end of
    sequence is turned off with its own ``generation_config`` field, a JSON string
    (``"eos_token_id": -1``: its continuous batching keeps no end token), instead of
    ``ignore_eos``; greedy there too (``do_sample`` false)."""

    name = "transformers"

    def body(self, request: StreamRequest, model: str | None) -> dict[str, Any]:
        body = super().body(replace(request, ignore_eos=False), model)
        if request.ignore_eos:
            body["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": False})
        return body


class LlamaServerWire(OpenAIWire):
    """``openai`` for ``llama-server`` (``tools/peers/llama_server.py``): ``ignore_eos`` as asked,
    and ``"cache_prompt": false``, so that each prompt is prefilled in full as the other
    systems do (its slots would otherwise reuse a cached prefix of an earlier prompt)."""

    name = "llama"

    def body(self, request: StreamRequest, model: str | None) -> dict[str, Any]:
        return {**super().body(request, model), "cache_prompt": False}


PROTOCOLS: dict[str, WireProtocol] = {
    "streamscope": StreamscopeWire(),
    "openai": OpenAIWire(),
    "transformers": TransformersServeWire(),
    "llama": LlamaServerWire(),
}



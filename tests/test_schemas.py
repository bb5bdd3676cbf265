"""Tests for app.schemas without a server: the limits are one set for every body.

The HTTP tests (``test_app_refusals.py``, ``test_app_openai.py``) check each refusal's
answer; these check what the package promises: the sampling ranges are the engine's
own, and a limit refuses with the same words whichever body breaks it.
"""

from __future__ import annotations

import json

import pydantic
import pytest

from app.schemas import (
    MAX_DEADLINE_MS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatBody,
    CompletionsBody,
    GenerateBody,
    RequestLimits,
    parse_generate_body,
)
from engine import MAX_SEED, MAX_TEMPERATURE
from streams import PolicyName

LIMITS = RequestLimits(max_prompt_chars=10, max_new_tokens_limit=20, default_max_new_tokens=7,
                       request_policies=frozenset({PolicyName.DROP}))


def problems(body: dict[str, object]) -> dict[str, set[tuple[str, str]]]:
    """Each body's problems (type, message) with ``body``, its prompt sent as the body
    expects it (``messages`` for chat)."""
    found: dict[str, set[tuple[str, str]]] = {}
    prompt = body.pop("prompt", "hi")
    native = {"prompt": prompt, **body}
    chat = {"messages": [{"role": "user", "content": prompt}], **body}
    for name, parse in [
        ("native", lambda raw: parse_generate_body(raw, LIMITS)),
        ("completions", lambda raw: CompletionsBody.model_validate_json(raw, context=LIMITS)),
        ("chat", lambda raw: ChatBody.model_validate_json(raw, context=LIMITS)),
    ]:
        payload = chat if name == "chat" else native
        if name != "native" and "max_new_tokens" in payload:
            payload = {**payload}
            payload["max_tokens"] = payload.pop("max_new_tokens")
        with pytest.raises(pydantic.ValidationError) as caught:
            parse(json.dumps(payload).encode())
        found[name] = {(p["type"], p["msg"]) for p in caught.value.errors()}
    return found


@pytest.mark.parametrize("body", [
    {"prompt": "x" * 11},
    {"max_new_tokens": 21},
    {"temperature": MAX_TEMPERATURE + 0.5},
    {"temperature": -0.5},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"seed": MAX_SEED + 1},
    {"seed": -1},
    {"stop": ["s"] * (MAX_STOP_STRINGS + 1)},
    {"stop": ["x" * (MAX_STOP_CHARS + 1)]},
    {"deadline_ms": MAX_DEADLINE_MS + 1},
    {"deadline_ms": 0.0},
], ids=lambda body: next(iter(body)))
def test_every_body_refuses_a_limit_with_the_same_words(body: dict[str, object]) -> None:
    """(The OpenAI bodies also name the union member a ``stop`` string failed as.)"""
    found = problems(body)

    assert len(found["native"]) == 1
    assert found["native"] <= found["completions"] == found["chat"]


def test_the_sampling_limits_are_the_engines() -> None:
    at_the_limit = json.dumps({"prompt": "hi", "temperature": MAX_TEMPERATURE,
                               "seed": MAX_SEED}).encode()

    body = parse_generate_body(at_the_limit, LIMITS)

    assert (body.temperature, body.seed) == (MAX_TEMPERATURE, MAX_SEED)
    assert CompletionsBody.model_validate_json(at_the_limit, context=LIMITS).seed == MAX_SEED


def test_the_prompt_limit_counts_the_messages_text() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "x" * 6},
                                   {"role": "user", "content": [{"type": "text",
                                                                 "text": "y" * 5}]}]})

    with pytest.raises(pydantic.ValidationError) as caught:
        ChatBody.model_validate_json(raw, context=LIMITS)

    assert caught.value.errors()[0]["msg"] == (
        "the prompt has 11 characters, over the limit of 10"
    )


def test_a_body_validated_without_the_limits_says_how_to_validate_it() -> None:
    with pytest.raises(TypeError, match="parse_generate_body"):
        GenerateBody.model_validate_json(b'{"prompt": "hi"}')
    with pytest.raises(TypeError, match="request limits as its context"):
        CompletionsBody.model_validate_json(b'{"prompt": "hi"}')

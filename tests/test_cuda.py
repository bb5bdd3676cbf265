"""The engine on a CUDA GPU: what ``python -m tools.gpu_check`` runs there (``-m cuda``).

Skipped where torch sees no CUDA device (every CPU machine); the GPU check runs them on
a lent GPU. They ask of the GPU what the CPU tests ask of the CPU: the tiny model decodes
in each precision the GPU offers, a seeded run repeats, and a concurrent answer equals its
solo run bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import engine
from engine.engine import Engine
from engine.model import load_model
from engine.precision import CPU_ONLY, PRECISIONS, check

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="no CUDA device")]
GPU_PRECISIONS = [p for p in PRECISIONS if p not in CPU_ONLY]
PROMPTS = ["The capital of France is", "A stream is", "Every stream has an owner", "0123"]


def _answers(built: Engine, params: engine.SamplingParams, prompts: list[str]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        built.submit(engine.GenerationRequest(f"r{i}", prompt, 12, sampling=params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while built.has_work():
        for event in built.step():
            if isinstance(event, engine.TokenEvent):
                tokens[event.request_id].append(event.token_id)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("precision", GPU_PRECISIONS)
@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_concurrent_answer_is_its_solo_answer_on_the_gpu(
    precision: str, model: str, seed: int | None,
) -> None:
    check(precision, torch.device("cuda"))
    loaded = load_model(model, "cuda", precision=precision)
    params = (engine.SamplingParams(ignore_eos=True) if seed is None
              else engine.SamplingParams(temperature=0.9, seed=seed, ignore_eos=True))
    built = Engine(loaded, max_batch=len(PROMPTS), num_blocks=64, block_size=4)

    solo = [_answers(built, params, [p])[0] for p in PROMPTS]
    together = _answers(built, params, PROMPTS)

    assert all(len(answer) == 12 for answer in solo)
    assert together == solo

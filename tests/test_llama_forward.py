"""The engine's own Llama pass gives transformers' logits bit for bit, in every precision.

``engine.llama_forward.LlamaPass`` replaces the library's model call for Llama models
(fewer Python calls around the same ops, joined projections where the precision joins
them: ``engine.fused_projections``). Every pass an engine makes here (prefills, chunked
prefills, mixed steps, decodes) is also run through the library's own
``LlamaForCausalLM`` forward on the same weights and cache, and the logits must be
equal, not close. The tiny Llama's key and value projections (32 outputs) are too
narrow for the int4 packing to join, so a second tiny Llama, its heads twice as wide,
has every join the embedded model has.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import GenerationRequest, SamplingParams, llama_forward
from engine import precision as precisions
from engine.engine import Engine
from engine.int4_linear import Int4Linear
from engine.model import TINY_EOS, TINY_SEED, LoadedModel, load_model, tiny_tokenizer
from engine.paged_batch import PagedBatch
from engine.precision import PRECISIONS
from tests.engine_steps import run_until_idle, tokens_by_request

PROMPTS = ["The capital of France is", "A", "Über Straße, naïve café, déjà vu.",
           "The capital of Italy is Rome. The capital of France is Paris. A stream is an HTTP"]
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)


def _wide_llama_int4() -> LoadedModel:
    """A tiny Llama in int4 whose every projection the packing can join (64 outputs
    and more)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=384, hidden_size=128, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2, eos_token_id=0,
                         bos_token_id=0, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config).eval()
    tokenizer = tiny_tokenizer()
    model = precisions.apply(model, "int4")
    return LoadedModel("wide-llama", model, tokenizer, torch.device("cpu"), 512,
                       frozenset({tokenizer.convert_tokens_to_ids(TINY_EOS)}), "int4")


def _checked(engine: Engine) -> list[bool]:
    """Make every pass of ``engine`` run both forwards; one verdict per pass."""
    runner = engine.runner
    lean = runner.llama_pass  # type: ignore[attr-defined]
    assert lean is not None
    verdicts: list[bool] = []

    def both(input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
             keep: int | torch.Tensor) -> torch.Tensor:
        expected = runner.model(input_ids=input_ids, position_ids=positions,  # type: ignore[attr-defined]
                                paged=batch, use_cache=False, logits_to_keep=keep).logits
        got: torch.Tensor = lean(input_ids, positions, batch, keep)
        verdicts.append(torch.equal(got, expected))
        return got

    runner.llama_pass = both  # type: ignore[attr-defined]
    return verdicts


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_pass_gives_the_librarys_logits(
    precision: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    # A small prefill budget: prompts come in chunks, beside running decode rows.
    engine = make_tiny_engine("tiny-llama", precision, max_batch=8, num_blocks=64,
                              block_size=4, max_prefill_tokens=8)
    verdicts = _checked(engine)
    for i, prompt in enumerate(PROMPTS):
        sampling = SEEDED if i % 2 else SamplingParams(ignore_eos=True)
        engine.submit(GenerationRequest(f"r{i}", prompt, 6, sampling=sampling))
    got = tokens_by_request(run_until_idle(engine))
    assert sorted(got) == [f"r{i}" for i in range(len(PROMPTS))]
    assert len(verdicts) > len(PROMPTS) and all(verdicts), verdicts


def test_the_joined_projections_give_the_librarys_logits_and_share_the_parts_weights(
) -> None:
    loaded = _wide_llama_int4()
    for layer in loaded.model.model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        for joined, parts in ((attn.qkv_proj, (attn.q_proj, attn.k_proj, attn.v_proj)),
                              (mlp.gate_up_proj, (mlp.gate_proj, mlp.up_proj))):
            assert isinstance(joined, Int4Linear) and joined.rows_per_call >= 1
            assert all(p.packed.untyped_storage().data_ptr()
                       == joined.packed.untyped_storage().data_ptr() for p in parts)
    engine = Engine(loaded, max_batch=8, num_blocks=64, block_size=4, max_prefill_tokens=8)
    verdicts = _checked(engine)
    for i, prompt in enumerate(PROMPTS):
        sampling = SEEDED if i % 2 else SamplingParams(ignore_eos=True)
        engine.submit(GenerationRequest(f"r{i}", prompt, 6, sampling=sampling))
    together = tokens_by_request(run_until_idle(engine))
    assert len(verdicts) > len(PROMPTS) and all(verdicts), verdicts
    for i, prompt in enumerate(PROMPTS):  # and each one alone: the same tokens
        alone = Engine(loaded, max_batch=8, num_blocks=64, block_size=4)
        sampling = SEEDED if i % 2 else SamplingParams(ignore_eos=True)
        alone.submit(GenerationRequest(f"r{i}", prompt, 6, sampling=sampling))
        assert tokens_by_request(run_until_idle(alone))[f"r{i}"] == together[f"r{i}"], prompt


def test_a_model_other_than_llama_keeps_the_librarys_forward() -> None:
    assert llama_forward.for_model(load_model("tiny-gpt2", "cpu").model) is None
    assert llama_forward.for_model(load_model("tiny-llama", "cpu").model) is not None

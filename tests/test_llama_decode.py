"""The compiled decode layers (``engine.llama_decode``) give the Python layers' bits.

``LlamaPass`` runs a decode pass of joined int4 layers through
``ScriptedDecode`` (TorchScript) and every other pass through its Python layers; a row's
logits must not depend on which path its pass took, so here each pass the compiled
layers take is also run through the Python layers and through transformers' own forward
on the same weights and cache, and the logits must be equal.
"""

from __future__ import annotations

from typing import Any

import torch

from engine import GenerationRequest, SamplingParams
from engine.engine import Engine
from engine.llama_decode import ScriptedDecode
from engine.llama_forward import LlamaPass
from engine.model import load_model
from engine.paged_batch import PagedBatch
from tests.engine_steps import run_until_idle, tokens_by_request
from tests.test_llama_forward import _wide_llama_int4

SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
# Prompts of one length bucket (one read group when decoded together), and one longer
# that ends first: passes of two read groups, then of one.
PROMPTS = ["The capital of France is", "The capital of Italy is",
           "A stream is an HTTP response that never seems to end, token after token"]
TOKENS = [10, 10, 3]


class _Watched:
    """A ``ScriptedDecode`` whose every call is also computed by the Python layers and by
    the library's forward; one verdict per call."""

    def __init__(self, llama: LlamaPass, model: Any) -> None:
        assert llama.scripted is not None
        self.scripted, self.llama, self.model = llama.scripted, llama, model
        self.verdicts: list[bool] = []
        self.groups: list[int] = []  # each compiled pass's read groups

    def fits(self, paged: PagedBatch, rows: int, new: int) -> bool:
        return self.scripted.fits(paged, rows, new)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 paged: PagedBatch, heads: int, kv_heads: int, dim: int) -> torch.Tensor:
        # The Python layers first, on a copy of the cache's state: both write the same
        # new keys and values at the same slots, so the order does not matter.
        python = hidden
        for layer in self.llama.layers:
            python = self.llama._layer(layer, python, cos, sin, paged, hidden.shape[0])
        got: torch.Tensor = self.scripted(hidden, cos, sin, paged, heads, kv_heads, dim)
        self.verdicts.append(torch.equal(got, python))
        self.groups.append(len(paged.reads))
        return got


def _engine_watched(max_batch: int) -> tuple[Engine, _Watched, list[bool]]:
    loaded = _wide_llama_int4()
    engine = Engine(loaded, max_batch=max_batch, num_blocks=64, block_size=4)
    llama: LlamaPass = engine.runner.llama_pass  # type: ignore[attr-defined]
    watched = _Watched(llama, loaded.model)
    llama.scripted = watched  # type: ignore[assignment]
    library: list[bool] = []

    def both(input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
             keep: int | torch.Tensor) -> torch.Tensor:
        expected = loaded.model(input_ids=input_ids, position_ids=positions, paged=batch,
                                use_cache=False, logits_to_keep=keep).logits
        got: torch.Tensor = llama(input_ids, positions, batch, keep)
        library.append(torch.equal(got, expected))
        return got

    engine.runner.llama_pass = both  # type: ignore[attr-defined]
    return engine, watched, library


def test_a_decode_of_joined_int4_layers_is_compiled() -> None:
    llama = LlamaPass(_wide_llama_int4().model)
    assert isinstance(llama.scripted, ScriptedDecode)
    assert llama.scripted.max_rows >= 1


def test_layers_without_joined_int4_projections_are_not_compiled() -> None:
    for precision in ("float32", "int4"):  # tiny-llama's kv projections are too narrow
        model = load_model("tiny-llama", "cpu", precision=precision).model
        assert LlamaPass(model).scripted is None, precision


def test_one_stream_decodes_through_the_compiled_layers_with_the_same_logits() -> None:
    engine, watched, library = _engine_watched(max_batch=1)
    engine.submit(GenerationRequest("solo", PROMPTS[0], 8, sampling=SEEDED))
    run_until_idle(engine)
    assert len(watched.verdicts) >= 6 and all(watched.verdicts), watched.verdicts
    assert all(library), library


def test_rows_decoded_together_get_their_solo_tokens_whichever_path() -> None:
    engine, watched, library = _engine_watched(max_batch=4)
    for i, prompt in enumerate(PROMPTS):
        engine.submit(GenerationRequest(f"r{i}", prompt, TOKENS[i], sampling=SEEDED))
    together = tokens_by_request(run_until_idle(engine))
    assert watched.verdicts and all(watched.verdicts), watched.verdicts
    assert 1 in watched.groups and max(watched.groups) > 1, watched.groups
    assert len(library) > len(watched.verdicts) and all(library), library
    for i, prompt in enumerate(PROMPTS):
        alone, _, solo_library = _engine_watched(max_batch=1)
        alone.submit(GenerationRequest(f"r{i}", prompt, TOKENS[i], sampling=SEEDED))
        assert tokens_by_request(run_until_idle(alone))[f"r{i}"] == together[f"r{i}"]
        assert all(solo_library)


def test_more_rows_than_a_kernel_call_takes_are_not_compiled_passes() -> None:
    engine = Engine(_wide_llama_int4(), max_batch=2, num_blocks=64, block_size=4)
    scripted = engine.runner.llama_pass.scripted  # type: ignore[attr-defined]
    assert isinstance(scripted, ScriptedDecode)
    seen: list[tuple[bool, bool]] = []
    runner: Any = engine.runner
    forward = runner.forward

    def record(input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
               keep: int | torch.Tensor) -> torch.Tensor:
        rows, new = input_ids.shape
        wide = scripted.fits(batch, rows, new)
        kept = [linear.rows_per_call for linear in scripted.linears]
        for linear in scripted.linears:  # as a calibration after the pass was made
            linear.rows_per_call = 1
        seen.append((wide, scripted.fits(batch, rows, new)))
        for linear, limit in zip(scripted.linears, kept, strict=True):
            linear.rows_per_call = limit
        return forward(input_ids, positions, batch, keep)  # type: ignore[no-any-return]

    runner.forward = record
    for i in range(2):
        engine.submit(GenerationRequest(f"r{i}", PROMPTS[i], 4, sampling=SEEDED))
    run_until_idle(engine)
    assert (True, False) in seen  # two rows: compiled at the kernel's size, not at one
    assert (False, False) in seen  # the prefill: never compiled


def test_a_layer_whose_calls_take_two_rows_at_least_keeps_every_pass_in_python() -> None:
    # As on an AMD EPYC, where a kernel computes a row alone by another path and the
    # calibration pads it to two (batch_invariance): the compiled calls do not pad.
    reference = Engine(_wide_llama_int4(), max_batch=2, num_blocks=64, block_size=4)
    engine = Engine(_wide_llama_int4(), max_batch=2, num_blocks=64, block_size=4)
    scripted = engine.runner.llama_pass.scripted  # type: ignore[attr-defined]
    assert isinstance(scripted, ScriptedDecode)  # whatever this CPU's floors are,
    scripted.linears[-1].min_rows_per_call = 2  # one layer's lone rows padded
    assert not scripted.rows_alone
    compiled: list[bool] = []
    runner: Any = engine.runner
    forward = runner.forward

    def record(input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
               keep: int | torch.Tensor) -> torch.Tensor:
        compiled.append(scripted.fits(batch, *input_ids.shape))
        return forward(input_ids, positions, batch, keep)  # type: ignore[no-any-return]

    runner.forward = record
    for each in (engine, reference):
        each.submit(GenerationRequest("r0", PROMPTS[0], 6, sampling=SEEDED))
    tokens = tokens_by_request(run_until_idle(engine))
    assert len(compiled) > 1 and not any(compiled)
    assert tokens == tokens_by_request(run_until_idle(reference))  # padding keeps the bits

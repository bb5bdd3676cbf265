"""The weights' precision (``engine.precision``, ``STREAMSCOPE_DTYPE``): what each one
loads, what the KV cache holds, and the refusal of a precision the device cannot run.
The CPU layers' own row-for-row promise is tests/test_cpu_linear.py.

The identity of concurrent and solo runs in each precision is tests/test_engine_identity.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest
import torch

import engine
from app.runtime import load_engine_from_settings
from app.settings import Settings, SettingsError
from engine import batch_invariance
from engine.cpu_linear import Int8Linear, _RowWise, packing_available
from engine.engine import Engine
from engine.int4_linear import Int4Linear
from engine.model import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.precision import (
    PRECISIONS,
    amx_cpu,
    auto_candidates,
    check,
    default_precision,
    native_bf16_cpu,
)

LINEAR_TYPES = ("Linear", "Conv1D", "PackedLinear", "Int8Linear", "Int4Linear")


def _linear_types(model: torch.nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__name__ in LINEAR_TYPES}


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_bfloat16_weights_and_cache_are_bfloat16(
    model: str, tiny_model: Callable[..., LoadedModel]
) -> None:
    loaded = tiny_model(model, "bfloat16")
    runner = cast(ModelRunner, Engine(loaded, max_batch=2, num_blocks=8, block_size=4).runner)

    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert {t.dtype for t in (*runner.cache.keys, *runner.cache.values)} == {torch.bfloat16}
    assert loaded.precision == "bfloat16"
    packed = {"PackedLinear"} if packing_available() else {"Linear", "Conv1D"} & _linear_types(
        tiny_model(model).model)
    assert _linear_types(loaded.model) == packed  # every linear layer, the output layer too


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_int8_quantizes_every_linear_layer_and_keeps_a_bfloat16_cache(
    model: str, tiny_model: Callable[..., LoadedModel],
) -> None:
    loaded = tiny_model(model, "int8")
    runner = cast(ModelRunner, Engine(loaded, max_batch=2, num_blocks=8, block_size=4).runner)
    layers = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]

    assert _linear_types(loaded.model) == {"Int8Linear"}  # GPT-2's Conv1D layers included
    assert {m.weight_int8.dtype for m in layers} == {torch.int8}
    assert {t.dtype for t in (*runner.cache.keys, *runner.cache.values)} == {torch.bfloat16}


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_int4_puts_every_layer_but_the_output_in_q4_1_blocks_with_a_bfloat16_cache(
    model: str, tiny_model: Callable[..., LoadedModel],
) -> None:
    loaded = tiny_model(model, "int4")
    runner = cast(ModelRunner, Engine(loaded, max_batch=2, num_blocks=8, block_size=4).runner)
    head = loaded.model.get_output_embeddings()
    layers = [m for m in loaded.model.modules() if isinstance(m, Int4Linear)]

    assert not any(type(m).__name__ in ("Linear", "Conv1D") for m in loaded.model.modules())
    # per block; a Llama block's gate and up projections joined too (fused_projections:
    # its 32-wide key and value ones are too narrow for the packing to join)
    assert len(layers) == 4 * 2 + (0 if model == "tiny-gpt2" else (3 + 1) * 2)
    assert not isinstance(head, Int4Linear) and isinstance(head, _RowWise)
    assert {t.dtype for t in (*runner.cache.keys, *runner.cache.values)} == {torch.bfloat16}
    assert all(m.rows_per_call >= 1 for m in loaded.model.modules()
               if isinstance(m, _RowWise))  # calibrated on this CPU


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_decodes_with_logprobs_and_seeded_sampling(
    precision: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    built = make_tiny_engine("tiny-llama", precision, max_batch=4, num_blocks=32, block_size=4)
    params = engine.SamplingParams(temperature=0.9, seed=7, ignore_eos=True, logprobs=True,
                                   top_logprobs=2)
    built.submit(engine.GenerationRequest("r", "The capital of France is", 5, sampling=params))
    events = []
    while built.has_work():
        events += built.step()
    tokens = [e for e in events if isinstance(e, engine.TokenEvent)]

    assert len(tokens) == 5
    assert all(e.logprobs is not None and len(e.logprobs.top) == 2 for e in tokens)


def test_auto_is_int4_with_amx_bfloat16_on_another_cpu_that_computes_it_float32_elsewhere(
) -> None:
    if amx_cpu():
        expected = "int4"
    else:
        expected = "bfloat16" if native_bf16_cpu() and packing_available() else "float32"
    assert default_precision(torch.device("cpu")) == expected
    assert default_precision(torch.device("cuda")) == "float32"
    assert auto_candidates(torch.device("cpu"))[0] == default_precision(torch.device("cpu"))
    assert load_model("tiny-llama", "cpu", precision="auto").precision == expected


@pytest.mark.parametrize(("amx", "order"), [(True, ["int4", "bfloat16"]),
                                            (False, ["bfloat16", "int4"])])
def test_auto_orders_its_candidates_by_the_cpu_kind(
    monkeypatch: pytest.MonkeyPatch, amx: bool, order: list[str],
) -> None:
    monkeypatch.setattr(engine.precision, "native_bf16_cpu", lambda: True)
    monkeypatch.setattr(engine.precision, "amx_cpu", lambda: amx)
    monkeypatch.setattr(engine.precision.cpu_linear, "packing_available", lambda: True)
    assert auto_candidates(torch.device("cpu"))[:2] == order


def _not_exact(kind: str) -> Callable[[_RowWise, int], batch_invariance.CallSizes]:
    """A stand-in for a CPU on which ``kind``'s kernel has no exact call size."""
    def measure(layer: _RowWise, max_rows: int) -> batch_invariance.CallSizes:
        if type(layer).__name__ == kind:
            return batch_invariance.CallSizes(1, 0)
        return measure_really(layer, max_rows)
    measure_really = batch_invariance.exact_rows
    return measure


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's precisions")
def test_a_precision_not_exact_on_this_cpu_is_refused_at_start_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batch_invariance, "exact_rows", _not_exact("Int8Linear"))
    settings = Settings(model="tiny-llama", device="cpu", dtype="int8", start_cache=False)

    with pytest.raises(SettingsError) as caught:
        load_engine_from_settings(settings)

    assert caught.value.problems == [
        "STREAMSCOPE_DTYPE=int8: int8 is not exact on this CPU: its Int8Linear kernel "
        "(64 to 384) does not give a row the same bits twice alone"]


def test_auto_does_not_choose_a_precision_not_exact_on_this_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As on a CPU with native bfloat16 (both kinds this project runs on), whatever this
    # one is: auto then has candidates to fall back through (bfloat16 runs emulated
    # elsewhere, slower but exact).
    monkeypatch.setattr(engine.precision, "native_bf16_cpu", lambda: True)
    monkeypatch.setattr(engine.precision, "amx_cpu", lambda: False)  # bfloat16 first
    candidates = auto_candidates(torch.device("cpu"))
    assert candidates[:2] == ["bfloat16", "int4"], candidates
    first = "PackedLinear"
    monkeypatch.setattr(batch_invariance, "exact_rows", _not_exact(first))

    loaded = load_model("tiny-llama", "cpu", precision="auto")

    assert loaded.precision in candidates[1:]  # the next one exact without that kernel
    assert first not in _linear_types(loaded.model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here may run both")
def test_the_gpu_precisions_are_refused_without_one_before_anything_loads() -> None:
    with pytest.raises(engine.PrecisionError, match="int8 runs on the CPU only"):
        load_model("tiny-gpt2", "cuda", precision="int8")
    with pytest.raises(engine.PrecisionError, match="int4 runs on the CPU only"):
        load_model("tiny-gpt2", "cuda", precision="int4")
    with pytest.raises(engine.PrecisionError, match="bfloat16 needs a GPU that computes it"):
        load_model("tiny-gpt2", "cuda", precision="bfloat16")
    with pytest.raises(engine.PrecisionError, match="unknown precision 'float16'"):
        check("float16", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here may run bfloat16")
def test_the_server_refuses_a_precision_its_device_cannot_run_naming_the_setting() -> None:
    settings = Settings(model="tiny-gpt2", device="cuda", dtype="bfloat16")

    with pytest.raises(SettingsError) as caught:
        load_engine_from_settings(settings)

    assert caught.value.problems == [
        "STREAMSCOPE_DTYPE=bfloat16: bfloat16 needs a GPU that computes it; cuda does not"]


def test_an_unknown_precision_is_a_settings_error_naming_the_variable() -> None:
    for value in ("float16", "qint8", "INT8"):
        with pytest.raises(SettingsError, match="STREAMSCOPE_DTYPE"):
            Settings.from_env({"STREAMSCOPE_DTYPE": value})
    for value in ("auto", *PRECISIONS):
        assert Settings.from_env({"STREAMSCOPE_DTYPE": value}).dtype == value
    assert Settings().dtype == "auto"

"""The weights' precision (``engine.precision``, ``STREAMSCOPE_DTYPE``): what each one
loads, what the KV cache holds, the refusal of a precision the device cannot run, and
why the lab's int8 is not offered.

The identity of concurrent and solo runs in each precision is tests/test_engine_identity.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import engine
from app.runtime import load_engine_from_settings
from app.settings import Settings, SettingsError
from engine import precision as engine_precision
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from engine.precision import LAB_PRECISIONS, PRECISIONS, check


def _linear_types(model: torch.nn.Module) -> set[str]:
    return {type(m).__module__ + "." + type(m).__name__ for m in model.modules()
            if type(m).__name__ in ("Linear", "Conv1D")}


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_bfloat16_weights_and_cache_are_bfloat16(
    model: str, tiny_model: Callable[..., LoadedModel]
) -> None:
    loaded = tiny_model(model, "bfloat16")
    runner = Engine(loaded, max_batch=2, num_blocks=8, block_size=4).runner

    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert {t.dtype for t in (*runner.cache.keys, *runner.cache.values)} == {torch.bfloat16}
    assert loaded.precision == "bfloat16"


def test_int8_quantizes_every_linear_layer_and_keeps_a_float32_cache(
    tiny_model: Callable[..., LoadedModel],
) -> None:
    loaded = tiny_model("tiny-llama", "int8")
    runner = Engine(loaded, max_batch=2, num_blocks=8, block_size=4).runner
    plain = _linear_types(tiny_model("tiny-llama").model)

    assert plain == {"torch.nn.modules.linear.Linear"}
    assert _linear_types(loaded.model) == {"torch.ao.nn.quantized.dynamic.modules.linear.Linear"}
    assert {t.dtype for t in (*runner.cache.keys, *runner.cache.values)} == {torch.float32}


@pytest.mark.parametrize("precision", LAB_PRECISIONS)
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


def test_int8_rows_depend_on_their_batch_mates_so_the_product_does_not_offer_it() -> None:
    # One activation scale per input tensor: a row batched with a row of larger values
    # is quantized more coarsely than alone (float32 and bfloat16 rows are not).
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64)).eval()
    row, loud = torch.randn(1, 64), 50 * torch.randn(1, 64)
    int8 = engine_precision.apply(layer, "int8")  # type: ignore[arg-type]
    alone, batched = int8(row), int8(torch.cat([row, loud]))[:1]

    assert "int8" not in PRECISIONS and "int8" in LAB_PRECISIONS
    assert not torch.equal(alone, batched)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here may run both")
def test_the_gpu_precisions_are_refused_without_one_before_anything_loads() -> None:
    with pytest.raises(engine.PrecisionError, match="int8 runs on the CPU only"):
        load_model("tiny-gpt2", "cuda", precision="int8")
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
    for value in ("float16", "int8"):  # int8: the lab's only
        with pytest.raises(SettingsError, match="STREAMSCOPE_DTYPE"):
            Settings.from_env({"STREAMSCOPE_DTYPE": value})
    assert Settings.from_env({"STREAMSCOPE_DTYPE": "bfloat16"}).dtype == "bfloat16"
    assert Settings().dtype == "float32"

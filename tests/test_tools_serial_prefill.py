"""The exact mode (``tools/serial_prefill.py``): one prefill pass per prompt, injected as a
runner, the same tokens as the engine's packed pass; ``tools.bench burst``'s ``serial``
setting builds its engine with it."""

from __future__ import annotations

from collections.abc import Callable

from engine import GenerationRequest, SamplingParams, TokenEvent
from engine.model import LoadedModel
from tests.engine_steps import run_until_idle
from tests.scripted_runner import ScriptedRunner, scripted_engine
from tools.bench import burst
from tools.serial_prefill import SerialPrefill


def test_serial_prefill_runs_a_pass_per_prompt_and_makes_the_packed_tokens() -> None:
    packed_runner, serial_runner = ScriptedRunner(), ScriptedRunner()
    engines = {"packed": scripted_engine(packed_runner),
               "serial": scripted_engine(SerialPrefill(serial_runner), mixed_step=False)}
    tokens = {}
    for name, engine in engines.items():
        for request_id, prompt in (("a", "abc"), ("b", "defgh"), ("c", "ij")):
            engine.submit(GenerationRequest(request_id, prompt, 3, sampling=SamplingParams()))
        events = run_until_idle(engine)
        tokens[name] = [(e.request_id, e.token_id) for e in events if isinstance(e, TokenEvent)]
    assert tokens["serial"] == tokens["packed"]
    assert packed_runner.prefills == [["a", "b", "c"]]
    assert serial_runner.prefills == [["a"], ["b"], ["c"]]


def test_burst_bench_serial_setting_injects_the_serial_runner(
    tiny_model: Callable[[str], LoadedModel],
) -> None:
    serial = burst.bench_engine(tiny_model("tiny-gpt2"), {"pack_prefill": False})
    assert isinstance(serial.runner, SerialPrefill) and not serial.mixed_step
    packed = burst.bench_engine(tiny_model("tiny-gpt2"), {})
    assert not isinstance(packed.runner, SerialPrefill) and packed.mixed_step

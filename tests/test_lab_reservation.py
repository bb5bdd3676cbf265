"""The lab's reservation admission (``tools/lab/reservation.py``), through the engine's seam.

Reservation (every block a request may need, at admission: issue 14's comparison) is a
lab device: it reaches an engine only as ``Engine(admission=RESERVATION)``, and the lab's
server only through ``STREAMSCOPE_LAB_KV_ADMISSION=reserve``; the service has no setting
for it and refuses ``STREAMSCOPE_KV_ADMISSION`` (``tests/test_engine_capacity.py``). The
scheduling is checked on the real Engine over the scripted runner, the blocks held on the
tiny random model.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine import GenerationRequest, SamplingParams
from engine.engine import Engine
from tests.engine_steps import run_until_idle
from tests.scripted_runner import scripted_engine
from tools.lab._settings import LabSettings, LabSettingsError
from tools.lab.reservation import RESERVATION, load_reserving_engine

MakeEngine = Callable[..., Engine]


def _submit(engine: Engine, request_id: str, prompt: str, max_new: int) -> None:
    engine.submit(GenerationRequest(request_id, prompt, max_new, sampling=SamplingParams()))


def test_the_reservation_scheme_holds_every_block_from_admission() -> None:
    engine = scripted_engine(num_blocks=16, block_size=4, admission=RESERVATION)
    _submit(engine, "a", "abcd", 9)
    engine.step()
    assert engine.statistics().blocks_reserved == 4
    assert engine.statistics().blocks_filled == 1
    run_until_idle(engine)


def test_on_demand_admits_more_than_worst_case_reservations_would() -> None:
    engines = {"reserve": scripted_engine(num_blocks=16, block_size=4, admission=RESERVATION),
               "on_demand": scripted_engine(num_blocks=16, block_size=4)}
    for engine in engines.values():
        for i in range(8):
            _submit(engine, f"r{i}", "abcd", 20)  # 24 positions: 6 blocks reserved
        engine.step()
    assert engines["reserve"].statistics().running == 2
    assert engines["on_demand"].statistics().running == 8
    for engine in engines.values():
        run_until_idle(engine)


def test_a_reserving_engine_holds_its_blocks_from_admission_until_the_finish(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine(num_blocks=16, block_size=4, admission=RESERVATION)
    # 8 prompt tokens + 5 new = 13 positions: 4 blocks, all at admission.
    engine.submit(
        GenerationRequest(
            "a", "The capital of France is", 5, sampling=SamplingParams(ignore_eos=True)
        )
    )
    reserved = []
    while engine.has_work():
        engine.step()
        reserved.append(engine.statistics().blocks_reserved)
    assert reserved == [4, 4, 4, 4, 0]
    assert engine.statistics().releases == 1
    assert engine.statistics().preemptions == 0


def test_the_lab_server_chooses_reservation_by_its_own_setting() -> None:
    from app.settings import Settings

    assert LabSettings.from_env({}).kv_admission == "on_demand"
    chosen = LabSettings.from_env({"STREAMSCOPE_LAB_KV_ADMISSION": "reserve"})
    assert chosen.kv_admission == "reserve"
    with pytest.raises(LabSettingsError, match="STREAMSCOPE_LAB_KV_ADMISSION"):
        LabSettings.from_env({"STREAMSCOPE_LAB_KV_ADMISSION": "greedy"})
    built = load_reserving_engine(Settings(
        model="tiny-gpt2", device="cpu", block_size=4, cache_memory=2**20))
    assert built.scheduler.admission is RESERVATION  # type: ignore[attr-defined]
    assert built.allocator.num_blocks > 1  # type: ignore[attr-defined]

"""What a start records and keeps (issue 27): its phases, a saved calibration reused only
where a check agrees, the collector left alone during the build, tied weights kept once.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import engine
from app.runtime import loading
from app.settings import Settings
from engine import costs, start_cache, startup
from engine.engine import Engine
from engine.model import LoadedModel, _weights_once, tiny_gpt2

IDENTITY = {"model": "tiny-gpt2", "device": "cpu", "threads": 1}
OPTIONS: dict[str, Any] = {"max_step_ms": 50.0, "num_blocks": 64, "block_size": 4,
                           "max_batch": 4}


def calibrated(tiny_model: Callable[[str], LoadedModel], directory: Path | None,
               **options: Any) -> tuple[Engine, dict[str, float]]:
    with startup.recording() as phases, start_cache.reusing(directory, IDENTITY):
        built = Engine(tiny_model("tiny-gpt2"), **{**OPTIONS, **options})
    return built, phases.rounded()


def saved_files(directory: Path) -> list[Path]:
    return sorted((directory / "calibration").glob("*.json"))


def test_a_saved_calibration_is_reused_when_the_check_agrees(
    tiny_model: Callable[[str], LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, phases = calibrated(tiny_model, tmp_path)
    assert "calibration" in phases and "calibration_check" not in phases
    (file,) = saved_files(tmp_path)
    assert json.loads(file.read_text())["data"] == first.costs.snapshot()

    monkeypatch.setattr(costs, "REUSE_TOLERANCE", 1e9)  # any check agrees
    second, phases = calibrated(tiny_model, tmp_path)
    assert "calibration_check" in phases and "calibration" not in phases
    saved = first.costs.snapshot()
    reused = second.costs.snapshot()
    assert reused["prefills"] == saved["prefills"] and reused["mixed"] == saved["mixed"]
    assert reused["overruns"] == saved["overruns"]
    assert set(reused["decode_ms"]) == set(saved["decode_ms"])  # the check's decode joined
    assert second.costs.prefill_line() == first.costs.prefill_line()


def test_a_check_that_disagrees_calibrates_afresh_and_saves_anew(
    tiny_model: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    calibrated(tiny_model, tmp_path)
    (file,) = saved_files(tmp_path)
    stored = json.loads(file.read_text())
    stored["data"]["decode_ms"] = {k: 1e9 for k in stored["data"]["decode_ms"]}  # a slow past
    file.write_text(json.dumps(stored))

    again, phases = calibrated(tiny_model, tmp_path)
    assert "calibration_check" in phases and "calibration" in phases
    assert max(again.costs.snapshot()["decode_ms"].values()) < 1e9
    assert json.loads(file.read_text())["data"] == again.costs.snapshot()


def test_another_calibration_or_machine_is_not_reused(
    tiny_model: Callable[[str], LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(costs, "REUSE_TOLERANCE", 1e9)
    calibrated(tiny_model, tmp_path)
    _, phases = calibrated(tiny_model, tmp_path, max_batch=2)  # another detail
    assert "calibration_check" not in phases
    assert len(saved_files(tmp_path)) == 2
    detail = json.loads(saved_files(tmp_path)[0].read_text())["key"]["detail"]
    with start_cache.reusing(tmp_path, IDENTITY):
        assert start_cache.load("calibration", detail) is not None
    with start_cache.reusing(tmp_path, {**IDENTITY, "threads": 2}):  # another machine's
        assert start_cache.load("calibration", detail) is None


def test_without_a_place_to_keep_it_nothing_is_read_or_written(
    tiny_model: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    _, phases = calibrated(tiny_model, None)
    assert "calibration" in phases
    Engine(tiny_model("tiny-gpt2"), **OPTIONS)  # no reusing() at all: as the tests build them
    assert list(tmp_path.iterdir()) == []


def test_load_engine_records_its_phases_and_keeps_its_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(costs, "REUSE_TOLERANCE", 1e9)
    settings = Settings(model="tiny-gpt2", device="cpu", cache_blocks=64, max_step_ms=50.0)
    first = loading.build_and_freeze(loading.load_engine_from_settings, settings)
    gc.unfreeze()
    phases = getattr(first, "start_phases_s")  # noqa: B009  # engine.Engine's
    assert {"import_torch", "import_transformers", "to_device", "cache", "calibration",
            "gc_freeze"} <= set(phases)
    assert phases["process_until_load"] > 0
    assert all(isinstance(s, float) and s >= 0 for s in phases.values())
    assert saved_files(tmp_path / "streamscope")

    second = engine.load_engine("tiny-gpt2", "cpu", num_blocks=64, max_step_ms=50.0,
                                precision=settings.dtype)
    assert "calibration_check" in second.start_phases_s
    assert "calibration" not in second.start_phases_s
    off = engine.load_engine("tiny-gpt2", "cpu", num_blocks=64, max_step_ms=50.0,
                             start_cache=False)
    assert "calibration" in off.start_phases_s


def test_the_build_runs_no_full_collection_and_restores_the_thresholds() -> None:
    before = gc.get_threshold()
    during: list[tuple[int, int, int]] = []

    def make(settings: Settings) -> Any:
        during.append(gc.get_threshold())
        built = type("Built", (), {})()
        built.start_phases_s = {}
        return built

    built = loading.build_and_freeze(make, Settings(model="tiny-gpt2"))
    try:
        assert during == [(before[0], before[1], loading.NO_FULL_COLLECTION)]
        assert gc.get_threshold() == before
        assert set(getattr(built, "start_phases_s")) >= {"gc_freeze"}  # noqa: B009
    finally:
        gc.unfreeze()


def test_a_tied_weight_is_kept_once_under_the_model_s_first_name() -> None:
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    weights = _weights_once(model)
    assert "transformer.wte.weight" in weights and "lm_head.weight" not in weights
    assert set(weights) == set(model.state_dict()) - {"lm_head.weight"}


def test_a_phase_inside_another_counts_for_itself_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [0.0]  # the phases' clock, moved by hand (binary-exact steps): no real time passes
    monkeypatch.setattr(startup.time, "perf_counter", lambda: clock[0])

    def spend(seconds: float) -> None:
        clock[0] += seconds

    with startup.recording() as phases:
        with startup.phase("outer"):
            spend(0.03125)
            with startup.phase("inner"):
                spend(0.0625)
        with startup.phase("outer"):
            pass
    seconds = phases.seconds
    assert list(seconds) == ["inner", "outer"]
    assert 0.05 <= seconds["inner"] < 0.2
    assert 0.02 <= seconds["outer"] < 0.05
    with startup.phase("nobody records"):
        pass  # no recording open: nothing happens

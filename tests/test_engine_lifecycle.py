"""A request's life in the engine: validation, admission, cancel, pause, threads, on_prefill.

Loading without a network: ``tests/test_engine_offline.py``.

Every engine comes from ``make_tiny_engine``, which drains it at teardown and fails
the test unless the cache is whole again (every block free, nothing running or
waiting): each test here also checks that blocks go back exactly once.
"""

from __future__ import annotations

import math
import random
import threading
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from engine import (
    DuplicateRequestId,
    EmptyPrompt,
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidMaxNewTokens,
    InvalidRequest,
    InvalidSampling,
    PromptTooLong,
    SamplingParams,
    StepReentered,
    TokenEvent,
)
from engine.engine import Engine
from engine.model_runner import ModelRunner
from tests.engine_steps import run_until_idle
from tools.lab.reservation import RESERVATION

MakeEngine = Callable[..., Engine]
FIXED = SamplingParams(ignore_eos=True)  # lengths do not depend on the random model's eos
PROMPT = "The capital of France is"  # 8 tokens with the tiny tokenizer
THREAD_WAIT_S = 60  # only reached if the engine deadlocks


def _request(request_id: str, max_new: int = 4, prompt: str = PROMPT) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, max_new, sampling=FIXED)


def _tokens(events: list[EngineEvent], request_id: str) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == request_id]


def _finishes(events: list[EngineEvent], request_id: str) -> list[FinishEvent]:
    return [e for e in events if isinstance(e, FinishEvent) and e.request_id == request_id]


def _solo_ids(make_tiny_engine: MakeEngine, request: GenerationRequest) -> list[int]:
    engine = make_tiny_engine()
    engine.submit(request)
    return _tokens(run_until_idle(engine), request.request_id)


# -- bad input: one exception type per kind, nothing admitted -------------------------------


def _bad(error: type[InvalidRequest], name: str, **fields: object) -> object:
    """A parameter: ``fields`` of the request, sampling fields included, over good ones."""
    sampling = {k: fields.pop(k) for k in list(fields) if k in SamplingParams.__slots__}
    request = {"request_id": "x", "prompt": PROMPT, "max_new_tokens": 4, **fields}
    return pytest.param(
        error, GenerationRequest(**request, sampling=SamplingParams(**sampling)), id=name
    )


BAD_REQUESTS = [
    _bad(EmptyPrompt, "empty-prompt", prompt=""),
    _bad(InvalidMaxNewTokens, "max-new-0", max_new_tokens=0),
    _bad(InvalidMaxNewTokens, "max-new-negative", max_new_tokens=-1),
    _bad(InvalidMaxNewTokens, "max-new-float", max_new_tokens=1.5),
    _bad(InvalidMaxNewTokens, "max-new-bool", max_new_tokens=True),
    _bad(InvalidSampling, "temperature-negative", temperature=-1),
    _bad(InvalidSampling, "temperature-nan", temperature=math.nan),
    _bad(InvalidSampling, "top-p-0", top_p=0),
    _bad(InvalidSampling, "top-p-over-1", top_p=1.5),
    _bad(InvalidSampling, "top-k-negative", top_k=-1),
    _bad(InvalidSampling, "seed-negative", seed=-1),
    _bad(InvalidSampling, "seed-string", seed="x"),
    _bad(PromptTooLong, "over-the-cache", max_new_tokens=9),  # 8 + 9 > 16 positions
]


def _assert_nothing_admitted(engine: Engine) -> None:
    assert not engine.has_work()
    engine.step()
    stats = engine.statistics()
    assert (stats.waiting, stats.running, stats.blocks_free) == (0, 0, stats.blocks_total)


@pytest.mark.parametrize(("error", "request_"), BAD_REQUESTS)
def test_bad_request_raises_its_kind_and_admits_nothing(
    error: type[InvalidRequest], request_: GenerationRequest, make_tiny_engine: MakeEngine
) -> None:
    engine = make_tiny_engine(num_blocks=4, block_size=4)
    with pytest.raises(error):
        engine.submit(request_)
    _assert_nothing_admitted(engine)


def test_prompt_over_model_context_raises_prompt_too_long(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(num_blocks=200, block_size=4)  # 800 positions; the model has 512
    with pytest.raises(PromptTooLong):
        engine.submit(_request("x", 512 - 8 + 1))
    _assert_nothing_admitted(engine)


def test_prompt_filling_the_cache_exactly_is_accepted(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(num_blocks=4, block_size=4)
    assert engine.submit(_request("x", 16 - 8)) == 8
    events = run_until_idle(engine)
    assert _finishes(events, "x")[0].completion_tokens == 8


def test_duplicate_live_request_id_raises(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a"))
    with pytest.raises(DuplicateRequestId):
        engine.submit(_request("a"))
    engine.step()
    with pytest.raises(DuplicateRequestId):
        engine.submit(_request("a"))
    events = run_until_idle(engine)
    assert len(_finishes(events, "a")) == 1
    assert engine.statistics().releases == 1


def test_request_id_is_reusable_after_its_request_finished(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 2))
    first = _tokens(run_until_idle(engine), "a")
    engine.submit(_request("a", 2))
    assert _tokens(run_until_idle(engine), "a") == first


# -- cancel ---------------------------------------------------------------------------------


def test_cancel_waiting_request_finishes_it_without_tokens(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(max_batch=1)
    engine.submit(_request("running"))
    prompt_tokens = engine.submit(_request("waiting"))
    events = engine.step()
    assert engine.statistics().waiting == 1
    engine.cancel("waiting")
    events += run_until_idle(engine)
    assert _tokens(events, "waiting") == []
    assert _finishes(events, "waiting") == [
        FinishEvent("waiting", FinishReason.CANCELLED, prompt_tokens, 0)
    ]
    assert engine.statistics().releases == 1  # only "running" ever held blocks


def test_cancel_before_the_first_step_never_admits(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a"))
    engine.cancel("a")
    events = engine.step()
    assert events == [FinishEvent("a", FinishReason.CANCELLED, 8, 0)]
    assert engine.statistics().releases == 0


def test_cancel_running_request_releases_its_blocks(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 20))
    events = engine.step() + engine.step()
    assert engine.statistics().blocks_reserved > 0
    engine.cancel("a")
    last = engine.step()
    assert last == [FinishEvent("a", FinishReason.CANCELLED, 8, 2)]
    stats = engine.statistics()
    assert (stats.blocks_free, stats.releases, stats.running) == (stats.blocks_total, 1, 0)
    assert len(_tokens(events, "a")) == 2


def test_cancel_finished_request_does_nothing(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 2))
    run_until_idle(engine)
    engine.cancel("a")
    assert engine.step() == []
    assert engine.statistics().releases == 1


def test_cancel_unknown_request_does_nothing(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 3))
    engine.cancel("nobody")
    events = run_until_idle(engine)
    assert [e.reason for e in events if isinstance(e, FinishEvent)] == [FinishReason.LENGTH]


def test_cancel_twice_gives_one_finish_event(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 10))
    events = engine.step()
    engine.cancel("a")
    engine.cancel("a")
    events += engine.step()
    engine.cancel("a")
    events += run_until_idle(engine) + engine.step()
    assert [e.reason for e in _finishes(events, "a")] == [FinishReason.CANCELLED]
    assert engine.statistics().releases == 1


# -- pause and resume -----------------------------------------------------------------------


def test_paused_request_keeps_its_blocks_and_resumes_like_solo(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 8))
    engine.submit(_request("b", 8, "Every stream"))
    events = engine.step() + engine.step()
    reserved = engine.statistics().blocks_reserved
    engine.pause("a")  # applied at the start of the next step
    while_paused = engine.step() + engine.step() + engine.step()
    stats = engine.statistics()
    assert _tokens(while_paused, "a") == []
    assert len(_tokens(while_paused, "b")) == 3
    assert (stats.paused, stats.blocks_reserved) == (1, reserved)
    engine.resume("a")
    events += while_paused + run_until_idle(engine)
    assert _tokens(events, "a") == _solo_ids(make_tiny_engine, _request("a", 8))
    assert _tokens(events, "b") == _solo_ids(make_tiny_engine, _request("b", 8, "Every stream"))


def test_engine_has_no_work_when_every_running_request_is_paused(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 8))
    engine.step()
    engine.pause("a")
    engine.step()
    assert not engine.has_work()
    engine.resume("a")
    assert engine.has_work()


def test_cancel_paused_request_releases_its_blocks(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 8))
    engine.step()
    engine.pause("a")
    engine.step()
    engine.cancel("a")
    assert engine.step() == [FinishEvent("a", FinishReason.CANCELLED, 8, 1)]
    assert engine.statistics().blocks_free == engine.statistics().blocks_total


def test_request_paused_before_admission_gets_no_token(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a", 4))
    engine.pause("a")
    events = engine.step() + engine.step()
    engine.resume("a")
    assert _tokens(events, "a") == []


# -- admission: arrival order, batch limit --------------------------------------------------


def test_admission_keeps_arrival_order_when_blocks_run_short(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine(max_batch=4, num_blocks=8, block_size=4, admission=RESERVATION)
    engine.submit(_request("first", 4))  # 12 positions: 3 of the 8 blocks
    first_token_step: dict[str, int] = {}
    finish_step: dict[str, int] = {}
    engine.submit(_request("big", 16))  # 24 positions: 6 blocks, only 5 free while "first" runs
    engine.submit(_request("small", 3, "A"))  # 4 positions: 1 block, would fit at once
    for step in range(100):
        if not engine.has_work():
            break
        for event in engine.step():
            if isinstance(event, FinishEvent):
                finish_step[event.request_id] = step
            elif event.index == 0:
                first_token_step.setdefault(event.request_id, step)
    assert list(first_token_step) == ["first", "big", "small"]
    assert first_token_step["big"] == finish_step["first"] + 1
    assert first_token_step["small"] == first_token_step["big"]


def test_running_never_exceeds_max_batch(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(max_batch=3)
    for i in range(10):
        engine.submit(_request(f"r{i}", 1 + i % 4))
    sizes: list[int] = []  # after each prefill and after each step

    def on_prefill(events: list[EngineEvent]) -> None:
        sizes.append(len(engine.scheduler.running))

    while engine.has_work():
        engine.step(on_prefill=on_prefill)
        sizes.append(len(engine.scheduler.running))
        assert engine.statistics().running == sizes[-1]
    assert max(sizes) == 3
    assert engine.statistics().releases == 10


# -- a failing forward pass ----------------------------------------------------------------


def _break_forward(
    monkeypatch: pytest.MonkeyPatch, engine: Engine, fails: Callable[[torch.Tensor], bool]
) -> None:
    """Make this engine's forward pass raise for the inputs ``fails`` picks."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    forward = runner.forward

    def broken(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        if fails(input_ids):
            raise RuntimeError("injected failure")
        return forward(input_ids, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "forward", broken)


def test_failed_prefill_ends_only_that_request(
    make_tiny_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both prompts are packed into one prefill, which fails; each is retried alone.
    engine = make_tiny_engine()
    _break_forward(monkeypatch, engine, lambda ids: ids.shape[1] >= 8)  # any with PROMPT
    engine.submit(_request("bad"))
    engine.submit(_request("good", 3, "A"))
    events = run_until_idle(engine)
    assert _finishes(events, "bad") == [
        FinishEvent("bad", FinishReason.ERROR, 8, 0, "prefill failed: injected failure")
    ]
    assert [f.reason for f in _finishes(events, "good")] == [FinishReason.LENGTH]


def test_failed_decode_ends_every_request_in_the_batch(
    make_tiny_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a"))
    engine.submit(_request("b", 4, "A"))
    engine.step()
    _break_forward(monkeypatch, engine, lambda ids: True)
    events = engine.step()
    error = "decode failed: injected failure"
    assert events == [
        FinishEvent("a", FinishReason.ERROR, 8, 1, error),
        FinishEvent("b", FinishReason.ERROR, 1, 1, error),
    ]
    assert engine.statistics().releases == 2


# -- threads --------------------------------------------------------------------------------


def _assert_each_finished_once(
    events: list[EngineEvent], max_new: dict[str, int], cancelled: set[str]
) -> None:
    finishes = [e for e in events if isinstance(e, FinishEvent)]
    assert sorted(f.request_id for f in finishes) == sorted(max_new)  # one each, no more
    tokens = Counter(e.request_id for e in events if isinstance(e, TokenEvent))
    for finish in finishes:
        assert finish.completion_tokens == tokens[finish.request_id]
        if finish.request_id not in cancelled:
            assert finish.reason is FinishReason.LENGTH
            assert finish.completion_tokens == max_new[finish.request_id]
        elif finish.reason is FinishReason.CANCELLED:
            assert finish.completion_tokens < max_new[finish.request_id]
    # Cancels landed both before admission and while running.
    cancels = [f.completion_tokens for f in finishes if f.reason is FinishReason.CANCELLED]
    assert 0 in cancels
    assert any(cancels)


def test_submit_and_cancel_from_many_threads_finish_each_request_once(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine(max_batch=16, num_blocks=128, block_size=4)
    prompts = ["A", "Every stream", PROMPT, "日本語", "tokens leave as they are made"]
    stepped = threading.Condition()
    num_steps = 0
    cancelled: set[str] = set()
    max_new: dict[str, int] = {}
    errors: list[BaseException] = []

    def wait_for_steps(count: int) -> None:
        with stepped:
            target = num_steps + count
            stepped.wait_for(lambda: num_steps >= target, timeout=THREAD_WAIT_S)

    def client(index: int) -> None:
        rng = random.Random(index)
        try:
            for i in range(20):
                request_id = f"t{index}-{i}"
                max_new[request_id] = rng.randint(1, 8)
                engine.submit(_request(request_id, max_new[request_id], rng.choice(prompts)))
                if rng.random() < 0.4:  # itself, or one of its last few: waiting or running
                    cancelled.add(victim := f"t{index}-{rng.randint(max(0, i - 3), i)}")
                    engine.cancel(victim)
                if rng.random() < 0.1:
                    engine.cancel(f"unknown-{index}-{i}")
                if rng.random() < 0.8:  # usually let steps pass; sometimes submit in a burst
                    wait_for_steps(2)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    events: list[EngineEvent] = []
    for _ in range(1_000_000):  # steps run in this thread, submits and cancels in the others
        if not (any(t.is_alive() for t in threads) or engine.has_work()):
            break
        events += engine.step()
        with stepped:
            num_steps += 1
            stepped.notify_all()
    assert errors == []
    _assert_each_finished_once(events, max_new, cancelled)
    admitted = {e.request_id for e in events if isinstance(e, TokenEvent)}
    assert engine.statistics().releases == len(admitted)  # each admitted request, once


def test_step_entered_from_a_second_thread_raises(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    engine.submit(_request("a"))
    inside, release = threading.Event(), threading.Event()
    results: list[list[EngineEvent]] = []

    def hold(events: list[EngineEvent]) -> None:
        inside.set()
        release.wait(timeout=THREAD_WAIT_S)

    worker = threading.Thread(target=lambda: results.append(engine.step(on_prefill=hold)))
    worker.start()
    try:
        assert inside.wait(timeout=THREAD_WAIT_S)
        with pytest.raises(StepReentered):
            engine.step()
    finally:
        release.set()
        worker.join(timeout=THREAD_WAIT_S)
    assert results == [[]]  # the first step ran to its end


# -- on_prefill -----------------------------------------------------------------------------


def test_on_prefill_gets_the_first_tokens_in_arrival_order_before_the_decode(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine(mixed_step=False)  # two passes (mixed: test_engine_mixed_step)
    engine.submit(_request("early", 4))
    engine.step()
    for request_id in ("r0", "r1", "r2"):
        engine.submit(_request(request_id, 3))
    calls: list[tuple[list[EngineEvent], int]] = []

    def on_prefill(events: list[EngineEvent]) -> None:
        # How far "early" is when this call comes: its decode has not run yet.
        calls.append((events, len(engine.scheduler.running["early"].generated_ids)))

    returned = engine.step(on_prefill=on_prefill)
    first_tokens = [
        [(e.request_id, e.index) for e in events if isinstance(e, TokenEvent)]
        for events, _ in calls
    ]
    assert first_tokens == [[("r0", 0), ("r1", 0), ("r2", 0)]]  # one packed prefill
    assert [len(events) for events, _ in calls] == [3]  # the tokens and nothing else
    assert [progress for _, progress in calls] == [1]
    assert [(e.request_id, e.index) for e in returned if isinstance(e, TokenEvent)] == [
        ("early", 1)
    ]
    assert len(returned) == 1


def test_on_prefill_error_leaves_no_request_stranded(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    for request_id in ("r0", "r1", "r2"):
        engine.submit(_request(request_id, 3))

    def broken(events: list[EngineEvent]) -> None:
        raise RuntimeError("the event loop is gone")

    with pytest.raises(RuntimeError, match="event loop is gone"):
        engine.step(on_prefill=broken)
    events = run_until_idle(engine)
    assert {e.request_id for e in events if isinstance(e, FinishEvent)} == {"r0", "r1", "r2"}

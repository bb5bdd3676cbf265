"""Deadline-aware admission: a TTFT deadline refused at once if unmeetable, let go if missed.

Over real HTTP (a tiny GPT-2): the engine's steps are held (``RecordingEngine.hold``) so
that load queues while nothing runs; a refusal that comes back while the step is still
held did not wait for one. A deadline is a ``time.monotonic()`` value; the engine reads
it against its own clock (``Engine(clock=...)``), which the missed-deadline tests move
past it by hand (``EngineClock``) instead of sleeping. The scheduler's part runs on the
scripted runner, with ``now`` given.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pydantic
import pytest
import trio

from app.schemas import RequestLimits, parse_generate_body
from app.settings import Settings, SettingsError
from engine import FinishEvent, FinishReason, GenerationRequest
from streams import ServerSentEvent
from streams.errors import RETRY_AFTER_BUCKETS_S
from tests.http_clients import parse_sse, stream_body
from tests.http_server import RecordingEngine, RunningServer, StartServer
from tests.scripted_runner import scripted_engine
from tests.test_app_metrics import scrape, value

if TYPE_CHECKING:
    from engine.model import LoadedModel

LOADS = 3  # streams queued ahead of the probe while the step is held
# The missed-deadline tests' deadline, in real time: a request reaches the hub's check at
# open in milliseconds, so it is admitted however slow the machine; the engine's clock is
# then moved past it by hand, so no test waits for it.
DEADLINE_S = 1.0
LOAD_PROMPT = "one two three four five six seven eight nine ten " * 6


async def open_load(server: RunningServer, nursery: trio.Nursery) -> None:
    """Hold the engine's next step and queue LOADS streams behind it (each opened)."""

    async def one() -> None:
        async with server.client() as client:
            response = await client.post(
                "/v1/stream", json=stream_body(LOAD_PROMPT, max_new_tokens=4, ignore_eos=True))
        assert parse_sse(response.content)[-1].event == "done"

    opened = server.hub.statistics().opened + LOADS
    server.recorder.hold()
    for _ in range(LOADS):
        nursery.start_soon(one)
    await server.wait_for(lambda: server.hub.statistics().opened == opened, "the load to open")


class EngineClock:
    """The engine's clock: ``time.monotonic()`` plus ``ahead_s``, which a test raises to
    let a deadline pass for the engine at once (the hub and the app read time.monotonic
    itself: the admission check at open still sees the real time left)."""

    def __init__(self) -> None:
        self.ahead_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead_s


async def start_clocked(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], clock: EngineClock,
    **settings: Any,
) -> RunningServer:
    """A server whose engine reads TTFT deadlines against ``clock``."""
    from engine.engine import Engine  # tests may use engine internals; app may not

    loaded = tiny_model("tiny-gpt2")
    return await start_server(make_engine=lambda s: RecordingEngine(Engine(
        loaded, max_batch=s.max_batch, num_blocks=s.cache_blocks, block_size=s.block_size,
        clock=clock)), **settings)


async def warm_up(server: RunningServer) -> None:
    """One request, so the engine has measured a prefill and a decode step."""
    async with server.client() as client:
        response = await client.post("/v1/generate", json=stream_body(max_new_tokens=2))
    assert response.status_code == 200


async def test_an_unmeetable_deadline_is_refused_with_429_before_any_step(
    server: RunningServer,
) -> None:
    await warm_up(server)
    probe = "The capital of France is"
    async with trio.open_nursery() as nursery:
        await open_load(server, nursery)
        # Without the prompt's own tokens: the lower bound checked before its encode.
        estimate = server.recorder.estimate_ttft_ms(0)
        assert estimate is not None
        deadline_ms = estimate / 2
        steps = server.hub.statistics().steps
        async with server.client() as client:
            response = await client.post("/v1/stream", json=stream_body(
                probe, deadline_ms=deadline_ms))
        steps_during = server.hub.statistics().steps - steps  # the held step never ended
        server.recorder.release()
    assert response.status_code == 429, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "deadline_unmeetable"
    # Coarse: no estimate, no time left, a bucketed Retry-After (docs/security.md).
    assert set(error) == {"type", "message"} and "ms" not in error["message"]
    assert int(response.headers["Retry-After"]) in RETRY_AFTER_BUCKETS_S
    assert steps_during == 0  # it was answered while the step was held: it waited for none
    stats = server.hub.statistics()
    assert (stats.refused_deadline, stats.opened) == (1, 1 + LOADS)
    samples = await scrape(server)
    assert value(samples, "streamscope_deadline_refusals_total") == 1
    assert value(samples, "streamscope_refusals_total",
                 status="429", type="deadline_unmeetable") == 1


async def test_a_meetable_deadline_is_admitted_under_the_same_load(
    server: RunningServer,
) -> None:
    await warm_up(server)
    async with trio.open_nursery() as nursery:
        await open_load(server, nursery)
        async with server.client() as client, client.stream(
            "POST", "/v1/stream", json=stream_body(max_new_tokens=3, deadline_ms=60_000)
        ) as response:
            assert response.status_code == 200
            server.recorder.release()
            events = parse_sse(await response.aread())
    assert [e.event for e in events] == ["start", "token", "token", "token", "done"]
    assert server.hub.statistics().refused_deadline == 0


async def test_the_openai_routes_take_deadline_ms_and_refuse_in_their_shape(
    server: RunningServer,
) -> None:
    await warm_up(server)
    async with trio.open_nursery() as nursery:
        await open_load(server, nursery)
        estimate = server.recorder.estimate_ttft_ms(0)
        assert estimate is not None
        async with server.client() as client:
            response = await client.post("/v1/completions", json={
                "prompt": "Hello", "max_tokens": 2, "stream": True,
                "deadline_ms": estimate / 2})
        server.recorder.release()
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("deadline_unmeetable", "rate_limit_error")
    assert "estimate_ms" not in error
    assert int(response.headers["Retry-After"]) in RETRY_AFTER_BUCKETS_S


async def read_stream_past_deadline(
    server: RunningServer, clock: EngineClock, body: dict[str, Any]
) -> tuple[httpx.Response, list[ServerSentEvent]]:
    """POST /v1/stream with the step held; once its start event came, move the engine's
    clock past the deadline, release the step, and read to the end."""
    server.recorder.hold()
    async with server.client() as client, client.stream("POST", "/v1/stream", json=body) as r:
        raw, chunks = b"", r.aiter_raw()
        async for chunk in chunks:
            raw += chunk
            if b"event: start" in raw:
                break
        clock.ahead_s += 2 * DEADLINE_S  # the held step, when it runs, finds it past
        server.recorder.release()
        async for chunk in chunks:
            raw += chunk
    return r, parse_sse(raw)


async def test_a_request_waiting_past_its_deadline_ends_with_a_deadline_missed_event(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    # The server's default deadline; fresh, so no estimate yet: admitted.
    clock = EngineClock()
    server = await start_clocked(start_server, tiny_model, clock,
                                 ttft_deadline_ms=DEADLINE_S * 1000)
    response, events = await read_stream_past_deadline(server, clock,
                                                       stream_body(max_new_tokens=4))
    assert response.status_code == 200
    assert [e.event for e in events] == ["start", "error"]
    error = json.loads(events[-1].data)["error"]
    assert error["type"] == "deadline_missed"
    request_id = response.headers["X-Request-ID"]
    finish = await server.wait_finished(request_id)
    assert (finish.reason, finish.completion_tokens) == (FinishReason.DEADLINE, 0)
    assert request_id not in server.recorder.admitted()
    stats = server.hub.statistics()
    assert (stats.deadline_misses, stats.refused_deadline) == (1, 0)
    engine = server.recorder.statistics()
    assert (engine.blocks_free, engine.running, engine.waiting) == (engine.blocks_total, 0, 0)
    samples = await scrape(server)
    assert value(samples, "streamscope_deadline_misses_total") == 1
    assert value(samples, "streamscope_requests_finished_total",
                 finish_reason="deadline_missed") == 1


async def test_a_whole_answer_past_its_deadline_is_a_503_deadline_missed(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    clock = EngineClock()
    server = await start_clocked(start_server, tiny_model, clock)
    server.recorder.hold()
    async with server.client() as client, trio.open_nursery() as nursery:
        answers: list[httpx.Response] = []

        async def post() -> None:
            answers.append(await client.post(
                "/v1/generate", json=stream_body(deadline_ms=DEADLINE_S * 1000)))

        nursery.start_soon(post)
        await server.wait_for(lambda: server.hub.statistics().opened == 1, "the stream")
        clock.ahead_s += 2 * DEADLINE_S  # the held step, when it runs, finds it past
        server.recorder.release()
    assert answers[0].status_code == 503
    assert answers[0].json()["error"]["type"] == "deadline_missed"


def test_the_scheduler_lets_a_waiting_request_go_at_its_deadline_without_spinning() -> None:
    engine = scripted_engine(max_batch=1)
    engine.submit(GenerationRequest("a", "abcd", max_new_tokens=20))
    engine.step()  # "a" holds the only batch slot
    engine.pause("a")
    deadline = time.monotonic() + 60
    engine.submit(GenerationRequest("b", "abcd", ttft_deadline=deadline))
    engine.step()  # "b" waits for the slot
    assert not engine.has_work()  # "a" paused, "b" cannot be admitted: nothing to do
    assert engine.scheduler.expire_deadlines(deadline) == []  # due, not past
    [finish] = engine.scheduler.expire_deadlines(deadline + 0.001)
    assert isinstance(finish, FinishEvent)
    assert (finish.request_id, finish.reason, finish.completion_tokens) == (
        "b", FinishReason.DEADLINE, 0)
    assert not engine.scheduler.waiting and not engine.has_work()  # gone: no spin
    engine.cancel("a")
    engine.step()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_has_work_wakes_for_an_expired_waiting_request_and_one_step_ends_it() -> None:
    now = [100.0]  # the engine's clock, moved by hand
    engine = scripted_engine(max_batch=1, clock=lambda: now[0])
    engine.submit(GenerationRequest("a", "abcd", max_new_tokens=20))
    engine.step()
    engine.pause("a")
    engine.submit(GenerationRequest("b", "abcd", ttft_deadline=now[0] + 0.01))
    engine.step()
    assert not engine.has_work()
    now[0] += 0.02
    assert engine.has_work()
    events = engine.step()
    assert [(e.request_id, e.reason) for e in events if isinstance(e, FinishEvent)] == [
        ("b", FinishReason.DEADLINE)]
    assert not engine.has_work()
    engine.cancel("a")
    engine.step()


def test_a_request_whose_prefill_began_is_not_let_go() -> None:
    engine = scripted_engine()
    engine.submit(GenerationRequest("a", "abcd", max_new_tokens=3,
                                    ttft_deadline=time.monotonic() + 60))
    engine.step()  # prefilled: its first token came
    assert engine.scheduler.expire_deadlines(math.inf) == []


def test_a_request_admitted_with_a_cache_hit_is_let_go_at_its_deadline() -> None:
    # Prefix cache, 4-position blocks, 8 prompt tokens a step. "b" finds 3 blocks cached
    # (12 positions: num_prefilled starts at 12), is admitted beside "c", whose 7
    # positions take the step's budget; "b" waits admitted (then paused), and at its
    # deadline no pass has computed any of its own positions: it is let go, its
    # references released.
    now = [100.0]
    engine = scripted_engine(clock=lambda: now[0], prefix_cache=True, max_prefill_tokens=8)
    cached = tuple(range(65, 79))  # 14 tokens
    engine.submit(GenerationRequest("a", "", 1, prompt_token_ids=cached))
    while engine.has_work():
        engine.step()
    # "c" due first: earliest deadline first keeps it ahead of "b" (engine.priority); its
    # prefill begins at once, so its own deadline never lets it go.
    engine.submit(GenerationRequest("c", "", 4, prompt_token_ids=tuple(range(90, 97)),
                                    ttft_deadline=now[0] + 0.005))
    engine.submit(GenerationRequest("b", "", 4, prompt_token_ids=cached,
                                    ttft_deadline=now[0] + 0.01))
    engine.step()
    b = engine.scheduler.running["b"]
    assert b.block_table is not None and b.block_table.num_hit_tokens == b.num_prefilled == 12
    engine.pause("c")  # both paused: only the deadline wakes the idle loop
    engine.pause("b")
    engine.step()
    assert "b" in engine.scheduler.running and not engine.has_work()
    now[0] += 0.02
    assert engine.has_work()
    events = engine.step()
    assert [(e.request_id, e.reason) for e in events if isinstance(e, FinishEvent)] == [
        ("b", FinishReason.DEADLINE)]
    engine.cancel("c")
    engine.step()
    engine.allocator.check()
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("raw", ["0", "-5", "nan", "inf", "soon"])
def test_a_bad_default_deadline_fails_at_startup(raw: str) -> None:
    expected = re.escape(f"STREAMSCOPE_TTFT_DEADLINE_MS={raw!r}: expected a")
    with pytest.raises(SettingsError, match=expected):
        Settings.from_env({"STREAMSCOPE_TTFT_DEADLINE_MS": raw})


def test_the_default_deadline_is_read_in_milliseconds() -> None:
    assert Settings.from_env({}).ttft_deadline_ms is None
    assert Settings.from_env({"STREAMSCOPE_TTFT_DEADLINE_MS": "250"}).ttft_deadline_ms == 250.0
    with pytest.raises(SettingsError, match="STREAMSCOPE_TTFT_DEADLINE_MS"):
        Settings(ttft_deadline_ms=0.0)


@pytest.mark.parametrize("deadline", [0, -1, "100", 600_001, True])
def test_a_bad_deadline_ms_in_the_body_is_invalid(deadline: object) -> None:
    limits = RequestLimits.from_settings(Settings())
    raw = json.dumps({"prompt": "hi", "deadline_ms": deadline}).encode()
    with pytest.raises(pydantic.ValidationError) as caught:
        parse_generate_body(raw, limits)
    [problem] = caught.value.errors()
    assert problem["loc"] == ("deadline_ms",)
    assert problem["type"] != "extra_forbidden"  # a known field, out of range or mistyped

"""KV capacity: blocks on demand, a watermark at admission, preemption by recompute.

The scheduling decisions are checked on the real Engine over the scripted runner
(``tests.scripted_runner``: letters count up, so every run's text is known); identity
after a preemption on the tiny random models: every token of a stream that lost its
blocks mid-stream and was recomputed equals the token of the same request run alone,
greedy and seeded. The cache sizing from memory is checked against the models' configs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
import trio

from engine import (
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from engine.admission import ON_DEMAND
from engine.engine import Engine
from engine.sequence import Chunk, SequenceState
from tests.engine_steps import run_until_idle, tokens_by_request
from tests.http_clients import parse_sse, stream_body
from tests.http_server import StartServer
from tests.scripted_runner import ScriptedRunner, scripted_engine

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


def _submit(engine: Engine, request_id: str, prompt: str = "abcd", max_new: int = 4,
            sampling: SamplingParams | None = None) -> None:
    engine.submit(GenerationRequest(request_id, prompt, max_new,
                                    sampling=sampling or SamplingParams()))


def _finishes(events: list[EngineEvent]) -> dict[str, FinishEvent]:
    finishes: dict[str, FinishEvent] = {}
    for event in events:
        if isinstance(event, FinishEvent):
            assert event.request_id not in finishes, f"{event.request_id} finished twice"
            finishes[event.request_id] = event
    return finishes


def _assert_whole(engine: Engine) -> None:
    engine.step()  # refresh the statistics
    stats = engine.statistics()
    assert (stats.blocks_free, stats.running, stats.waiting) == (stats.blocks_total, 0, 0)
    assert stats.releases == stats.admitted  # each table released once, none left


class RecordingRunner(ScriptedRunner):
    """A scripted runner that also records the token ids each chunk writes."""

    def __init__(self) -> None:
        super().__init__()
        self.chunk_ids: list[tuple[str, list[int], bool]] = []  # (id, chunk.ids, samples)

    def prefill(self, chunks: list[Chunk]) -> list[int | Exception | None]:
        self.chunk_ids += [(c.seq.request_id, c.ids, c.samples) for c in chunks]
        return super().prefill(chunks)


# -- on demand -----------------------------------------------------------------------------


def test_a_table_grows_a_block_when_the_next_position_needs_one() -> None:
    engine = scripted_engine(num_blocks=16, block_size=4)
    _submit(engine, "a", "abcd", 9)  # 13 positions: 4 blocks if reserved
    held = []
    while engine.has_work():
        engine.step()
        held.append(engine.statistics().blocks_reserved)
    # Positions 0-3 at the prefill; 4 at the first decode (a 2nd block), 8 (a 3rd),
    # then the finish. Position 12 (token 8's) is never written.
    assert held == [1, 2, 2, 2, 2, 3, 3, 3, 0]


@pytest.mark.parametrize(("watermark", "admitted_beside_a"), [(0.05, False), (0.0, True)])
def test_admission_leaves_the_watermark_free_while_others_run(
    watermark: float, admitted_beside_a: bool
) -> None:
    engine = scripted_engine(num_blocks=100, block_size=4, watermark=watermark)
    _submit(engine, "a", "abcd", 3)  # 1 block, then 2
    engine.step()
    # 96 blocks: 96 + 5 > 98 free while "a" runs; alone, over the watermark of 100.
    _submit(engine, "big", "x" * 383, 1)
    engine.step()
    stats = engine.statistics()
    assert (stats.running, stats.waiting) == ((2, 0) if admitted_beside_a else (1, 1))
    events = run_until_idle(engine)  # alone, "big" is admitted whatever the watermark
    assert _finishes(events)["big"].reason is FinishReason.LENGTH
    _assert_whole(engine)


# -- preemption ----------------------------------------------------------------------------


def _three_sharing_five_blocks(runner: ScriptedRunner) -> Engine:
    """a, b (1 block each) and c (2 blocks) admitted together over 5 blocks of 4; at the
    first decode a and b each need a 2nd block, and only one is free."""
    engine = scripted_engine(runner, num_blocks=5, block_size=4, watermark=0.0)
    _submit(engine, "a", "abcd", 6)
    _submit(engine, "b", "abcd", 6)
    _submit(engine, "c", "abcdef", 6)
    engine.step()
    return engine


def test_the_most_recently_admitted_sequence_is_preempted() -> None:
    runner = ScriptedRunner()
    engine = _three_sharing_five_blocks(runner)
    engine.step()
    assert runner.decodes == [["a", "b"]]  # c gave its blocks to b
    (c,) = engine.scheduler.waiting
    assert (c.request_id, c.state, c.block_table, c.num_preemptions) == (
        "c", SequenceState.WAITING, None, 1)
    stats = engine.statistics()
    assert (stats.preemptions, stats.running, stats.waiting) == (1, 2, 1)
    run_until_idle(engine)
    _assert_whole(engine)


def test_a_recompute_prefills_the_prompt_and_all_but_the_last_token_and_samples_nothing() -> None:
    runner = RecordingRunner()
    engine = scripted_engine(runner, num_blocks=4, block_size=4, watermark=0.0)
    _submit(engine, "a", "abcd", 8)
    _submit(engine, "b", "mnop", 8)
    events = []
    while engine.statistics().preemptions == 0:
        events += engine.step()
    assert engine.scheduler.waiting[0].request_id == "b"
    events += run_until_idle(engine)
    recompute = [(ids, samples) for rid, ids, samples in runner.chunk_ids[2:] if rid == "b"]
    generated = tokens_by_request(events)["b"]
    assert recompute == [(list(b"mnop") + generated[: len(recompute[0][0]) - 4], False)]
    assert "".join(map(chr, generated)) == "qrstuvwx"  # no token lost, none repeated
    assert engine.statistics().recomputed_tokens == len(recompute[0][0])
    _assert_whole(engine)


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_preempted_streams_equal_their_solo_runs(sampling: SamplingParams) -> None:
    prompts = ["abcd", "efg", "hijklm", "nop", "q", "rstuvw", "ab", "cdefghij"]

    def run(num_blocks: int, ids: list[int]) -> tuple[dict[str, list[int]], Engine]:
        engine = scripted_engine(num_blocks=num_blocks, block_size=4, watermark=0.0)
        for i in ids:
            _submit(engine, f"r{i}", prompts[i], 14, sampling)
        return tokens_by_request(run_until_idle(engine)), engine

    solo = {f"r{i}": run(64, [i])[0][f"r{i}"] for i in range(len(prompts))}
    got, engine = run(12, list(range(len(prompts))))
    assert engine.statistics().preemptions >= 4
    assert got == solo
    _assert_whole(engine)


def test_a_preempted_sequence_cancelled_while_waiting_is_released_once() -> None:
    runner = ScriptedRunner()
    engine = _three_sharing_five_blocks(runner)
    engine.step()  # c preempted
    engine.cancel("c")
    events = engine.step()
    assert _finishes(events)["c"].reason is FinishReason.CANCELLED
    assert engine.scheduler.find("c") is None
    events += run_until_idle(engine)
    assert set(_finishes(events)) == {"a", "b", "c"}
    _assert_whole(engine)
    assert engine.statistics().releases == 4  # a, b, c's first table; never a second


@pytest.mark.parametrize("seed", range(6))
def test_every_table_is_released_exactly_once_under_preempt_cancel_pause_and_finish(
    seed: int,
) -> None:
    rng = random.Random(seed)
    engine = scripted_engine(num_blocks=10, block_size=4, max_batch=6, watermark=0.0)
    live: list[str] = []
    events: list[EngineEvent] = []
    for step in range(400):
        if step < 150 and rng.random() < 0.5:
            rid = f"r{step}"
            _submit(engine, rid, "abcdefgh"[: rng.randint(1, 8)], rng.randint(1, 20),
                    rng.choice([SamplingParams(), SEEDED]))
            live.append(rid)
        if live and rng.random() < 0.15:
            engine.cancel(rng.choice(live))
        if live and rng.random() < 0.2:
            getattr(engine, rng.choice(["pause", "resume"]))(rng.choice(live))
        if step >= 150:
            for rid in live:
                engine.resume(rid)
        events += engine.step()  # a second release would raise DoubleRelease here
        if step >= 150 and not engine.has_work():
            break
    finishes = _finishes(events)
    assert set(finishes) == set(live)
    tokens = tokens_by_request(events)
    for rid, finish in finishes.items():
        assert finish.completion_tokens == len(tokens.get(rid, []))
    assert engine.statistics().preemptions > 0
    _assert_whole(engine)


# -- preemption on the tiny models: identity -----------------------------------------------

MODEL_PROMPTS = [
    "The capital of France is", "A", "Every stream has an owner", "0123", "Les élèves",
    "日本語", "tokens leave as they are made", "Rome",
]
MODEL_SAMPLINGS = {
    "greedy": SamplingParams(ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, ignore_eos=True),
}


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
@pytest.mark.parametrize("kind", list(MODEL_SAMPLINGS))
def test_streams_preempted_mid_stream_equal_their_solo_runs(
    model: str, kind: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    sampling = MODEL_SAMPLINGS[kind]
    requests = [GenerationRequest(f"r{i}", prompt, 24, sampling=sampling)
                for i, prompt in enumerate(MODEL_PROMPTS)]
    solo = {}
    for request in requests:
        alone = make_tiny_engine(model, max_batch=1, num_blocks=64, block_size=4)
        alone.submit(request)
        solo[request.request_id] = tokens_by_request(run_until_idle(alone))[request.request_id]
    engine = make_tiny_engine(model, max_batch=8, num_blocks=24, block_size=4)
    for request in requests:
        engine.submit(request)
    got = tokens_by_request(run_until_idle(engine))
    stats = engine.statistics()
    assert stats.preemptions >= 3 and stats.recomputed_tokens > 0
    assert got == solo



@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_preempted_streams_keep_their_solo_logprobs_bit_for_bit(
    precision: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    """A recompute replays a stream's tokens as the decode rows that made them, so its
    cache, and every later token's log-probabilities, are the solo run's, not just its
    argmax. (float32's products take another path for one row than for many.)"""
    sampling = SamplingParams(ignore_eos=True, logprobs=True, top_logprobs=2)
    requests = [GenerationRequest(f"r{i}", prompt, 24, sampling=sampling)
                for i, prompt in enumerate(MODEL_PROMPTS)]

    def logprobs(engine: Engine) -> dict[str, list[object]]:
        found: dict[str, list[object]] = {}
        for event in run_until_idle(engine):
            if isinstance(event, TokenEvent):
                found.setdefault(event.request_id, []).append(event.logprobs)
        return found

    solo = {}
    for request in requests:
        alone = make_tiny_engine("tiny-llama", precision, max_batch=1, num_blocks=64,
                                 block_size=4)
        alone.submit(request)
        solo.update(logprobs(alone))
    engine = make_tiny_engine("tiny-llama", precision, max_batch=8, num_blocks=24, block_size=4)
    for request in requests:
        engine.submit(request)
    got = logprobs(engine)
    assert engine.statistics().preemptions >= 3
    assert got == solo

# -- over HTTP: /stats and /metrics --------------------------------------------------------


async def test_preempted_streams_over_http_equal_solo_and_metrics_agree_with_stats(
    start_server: StartServer,
) -> None:
    from tests.test_app_metrics import scrape, stats, value

    server = await start_server(cache_blocks=8, block_size=4)  # 32 positions in all
    bodies = [stream_body(prompt=p, max_new_tokens=20, ignore_eos=True)
              for p in ("Rome", "A", "0123", "close")]

    async def text_of(body: dict[str, object], out: list[str]) -> None:
        async with server.client() as client:
            response = await client.post("/v1/stream", json=body)
        events = parse_sse(response.content)
        assert json.loads(events[-1].data)["finish_reason"] == "length"
        out.append("".join(json.loads(e.data)["text"] for e in events if e.event == "token"))

    solo: list[list[str]] = []
    for body in bodies:
        solo.append([])
        await text_of(body, solo[-1])
    assert (await stats(server))["preemptions"] == 0
    together: list[list[str]] = [[] for _ in bodies]
    async with trio.open_nursery() as nursery:
        for body, out in zip(bodies, together, strict=True):
            nursery.start_soon(text_of, body, out)
    assert together == solo
    current, samples = await stats(server), await scrape(server)
    assert current["preemptions"] > 0 and current["recomputed_tokens"] > 0
    assert value(samples, "streamscope_preemptions_total") == current["preemptions"]
    assert (value(samples, "streamscope_recomputed_tokens_total")
            == current["recomputed_tokens"])
    assert current["blocks_filled"] == 0
    # A prefix-cache series: the open /metrics leaves it out (no STREAMSCOPE_METRICS_TOKEN;
    # docs/security.md), since it moves when any key's prompt is found cached.
    assert ("streamscope_kv_cache_blocks_filled", ()) not in samples


# -- a cache sized from memory -------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_the_cache_is_sized_from_a_memory_budget_and_the_model_config(
    model: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    from engine.kv_cache import kv_bytes_per_token

    loaded = make_tiny_engine(model, num_blocks=4).loaded
    config = loaded.model.config  # type: ignore[attr-defined]
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * 4  # float32
    assert kv_bytes_per_token(config, loaded.model.dtype) == per_token  # type: ignore[attr-defined]

    engine = make_tiny_engine(model, block_size=4, cache_memory=per_token * 4 * 10 + 1)
    assert engine.allocator.num_blocks == 10
    cache = engine.runner.cache  # type: ignore[attr-defined]
    assert sum(t.nbytes for t in cache.keys + cache.values) == per_token * 4 * 10
    assert make_tiny_engine(model, num_blocks=7, cache_memory=10**9).allocator.num_blocks == 7
    capped = make_tiny_engine(model, max_batch=2, block_size=4, cache_memory=2**40)
    assert capped.allocator.num_blocks == 2 * loaded.max_context // 4  # never more than used
    share = make_tiny_engine(model, max_batch=1, block_size=4, cache_memory=1e-9)
    assert share.allocator.num_blocks >= 1


def test_the_settings_choose_the_cache_memory_and_refuse_an_admission_scheme() -> None:
    from app.runtime import load_engine_from_settings
    from app.settings import Settings, SettingsError

    env = Settings.from_env
    assert env({}).cache_blocks is None
    assert env({}).cache_memory == 0.1
    assert env({"STREAMSCOPE_CACHE_MEMORY": "512MiB"}).cache_memory == 512 * 2**20
    assert env({"STREAMSCOPE_CACHE_MEMORY": "2GB"}).cache_memory == 2 * 10**9
    assert env({"STREAMSCOPE_CACHE_MEMORY": "1048576"}).cache_memory == 2**20
    assert env({"STREAMSCOPE_CACHE_MEMORY": "0.25"}).cache_memory == 0.25
    for bad in ("1.5", "0.0", "lots", "-1GiB"):
        with pytest.raises(SettingsError, match="STREAMSCOPE_CACHE_MEMORY"):
            env({"STREAMSCOPE_CACHE_MEMORY": bad})
    for scheme in ("reserve", "on_demand"):  # reservation is the lab's (tools/lab)
        with pytest.raises(SettingsError, match="STREAMSCOPE_KV_ADMISSION is not a setting"):
            env({"STREAMSCOPE_KV_ADMISSION": scheme})
    built = load_engine_from_settings(Settings(
        model="tiny-gpt2", device="cpu", block_size=4, cache_memory=2**20))
    engine = built  # the production path: the Engine itself
    assert engine.scheduler.admission is ON_DEMAND  # type: ignore[attr-defined]
    assert engine.allocator.num_blocks > 1  # type: ignore[attr-defined]


# -- conformance: the scripted runner preempts as the model does -------------------------

PREEMPTING_SCENARIO: list[list[tuple[str, str, int]]] = [
    [("submit", "r0", 10), ("submit", "r1", 9), ("submit", "r2", 10), ("submit", "r3", 8)],
    [],
    [],
    [("cancel", "r3", 0)],  # preempted by then: cancelled while it waits
    [("pause", "r0", 0)],
    [("resume", "r0", 0), ("submit", "r4", 6)],
]


def _preempting_trace(engine: Engine) -> list[tuple[list[tuple[str, ...]], bool, int]]:
    from tests.test_engine_conformance import _shape

    trace: list[tuple[list[tuple[str, ...]], bool, int]] = []
    for step in range(80):
        if step < len(PREEMPTING_SCENARIO):
            for op, rid, max_new in PREEMPTING_SCENARIO[step]:
                if op == "submit":
                    engine.submit(GenerationRequest(
                        rid, "", max_new, sampling=SamplingParams(ignore_eos=True),
                        prompt_token_ids=(5, 6, 7)))  # the same length in both tokenizers
                else:
                    getattr(engine, op)(rid)
        elif not engine.has_work():
            return trace
        early: list[EngineEvent] = []
        late = engine.step(on_prefill=early.extend)
        shapes = [_shape(e, "early") for e in early] + [_shape(e, "late") for e in late]
        trace.append((shapes, engine.has_work(), engine.statistics().preemptions))
    raise AssertionError("still working after 80 steps")


def test_the_scripted_runner_and_the_model_preempt_alike(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    options: dict[str, Any] = {"max_batch": 4, "num_blocks": 6, "block_size": 4,
                               "watermark": 0.0}
    model = _preempting_trace(make_tiny_engine(**options))
    assert model[-1][2] >= 2  # preemptions happened
    assert _preempting_trace(scripted_engine(**options)) == model

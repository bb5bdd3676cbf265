"""A sequence's tokens do not depend on its batch mates, and match the library's own run.

Greedy and seeded on the tiny random models, in every precision the product offers
(``engine.precision``: float32, bfloat16, int8). "Solo" means the same request alone in
a fresh engine of the same precision; every other run must give token ids identical to
it. The library's own ``generate`` is the reference in float32. The tiny models' logits
are wide, so bfloat16's rounding flips no token here; on the embedded model it does at
near-ties (``python -m tools.lab precision``, docs/results.md). The paged attention
is also checked on its own against ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from engine import (
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    paged_batch,
)
from engine.attention import paged_attention
from engine.engine import Engine
from engine.kv_cache import PagedKVCache
from engine.model import LoadedModel, load_model
from engine.paged_batch import PagedBatch, decode_batch, prefill_batch
from engine.precision import PRECISIONS

MODELS = pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
PRECISION = pytest.mark.parametrize("precision", PRECISIONS)
GREEDY = SamplingParams(ignore_eos=True)  # fixed lengths: the random models may emit eos
# (prompt, max_new_tokens): prompt lengths 1..36 tokens, multi-byte text, 1..9 new tokens.
CASES = [
    ("The capital of France is", 6),
    ("A", 9),
    ("Every stream has an owner", 3),
    ("0123", 7),
    ("Les élèves", 1),
    ("日本語", 5),
    ("Emoji: 🙂", 8),
    ("tokens leave as they are made", 4),
    ("Rome", 2),
    ("Über Straße, naïve café, déjà vu.", 6),
    ("{ } < > !", 9),
    ("The capital of Italy is Rome. The capital of France is Paris. A stream is an HTTP", 5),
    ("close", 3),
    ("naïve", 7),
    ("?", 4),
    ("and every way it can end calls one close.", 8),
]
SEEDED = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
    SamplingParams(temperature=1.3, top_k=20, seed=2, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.5, top_k=8, seed=3, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=2**40, ignore_eos=True),
]
ENGINE_OPTIONS = {"max_batch": 16, "num_blocks": 128, "block_size": 4}

SoloIds = Callable[[str, str, GenerationRequest], list[int]]


def _request(
    request_id: str, prompt: str, max_new: int, sampling: SamplingParams = GREEDY
) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, max_new, sampling=sampling)


def _run_until_idle(engine: Engine) -> list[EngineEvent]:
    events: list[EngineEvent] = []
    for _ in range(500):
        if not engine.has_work():
            return events
        events += engine.step()
    raise AssertionError("the engine still has work after 500 steps")


def _ids_by_request(events: list[EngineEvent]) -> dict[str, list[int]]:
    """Token ids per request, checking every request finished by length."""
    ids: dict[str, list[int]] = {}
    for event in events:
        if isinstance(event, FinishEvent):
            assert event.reason is FinishReason.LENGTH, event
            assert event.completion_tokens == len(ids[event.request_id])
        else:
            tokens = ids.setdefault(event.request_id, [])
            assert event.index == len(tokens)
            tokens.append(event.token_id)
    return ids


@pytest.fixture(scope="module")
def solo_ids(tiny_model: Callable[..., LoadedModel]) -> SoloIds:
    """``solo_ids(model, precision, request)``: the ids of ``request`` run alone
    (memoized)."""
    memo: dict[tuple[str, str, str, int, SamplingParams], list[int]] = {}

    def run(model: str, precision: str, request: GenerationRequest) -> list[int]:
        key = (model, precision, request.prompt, request.max_new_tokens, request.sampling)
        if key not in memo:
            engine = Engine(tiny_model(model, precision), **ENGINE_OPTIONS)
            engine.submit(request)
            memo[key] = _ids_by_request(_run_until_idle(engine))[request.request_id]
            assert engine.allocator.num_free == engine.allocator.num_blocks
        return memo[key]

    return run


@PRECISION
@MODELS
@pytest.mark.parametrize("num_concurrent", [1, 2, 4, 8, 16])
def test_concurrent_sequences_equal_solo(
    model: str, precision: str, num_concurrent: int, make_tiny_engine: Callable[..., Engine],
    solo_ids: SoloIds,
) -> None:
    engine = make_tiny_engine(model, precision, **ENGINE_OPTIONS)
    requests = [_request(f"r{i}", *case) for i, case in enumerate(CASES[:num_concurrent])]
    for request in requests:
        engine.submit(request)
    got = _ids_by_request(_run_until_idle(engine))
    assert got == {r.request_id: solo_ids(model, precision, r) for r in requests}


@PRECISION
@MODELS
@pytest.mark.parametrize("pad_to", [paged_batch.PAD_TO, 2])
def test_late_joiners_equal_solo(
    model: str, precision: str, pad_to: int, make_tiny_engine: Callable[..., Engine],
    solo_ids: SoloIds, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Joiners arrive while others decode and after some finished: their tables reuse
    # freed blocks, and they decode in one batch with sequences far ahead of them
    # (padded to multiples of 2, in several length groups: a call each).
    monkeypatch.setattr(paged_batch, "PAD_TO", pad_to)
    engine = make_tiny_engine(model, precision, **ENGINE_OPTIONS)
    requests = [_request(f"r{i}", *case) for i, case in enumerate(CASES)]
    events: list[EngineEvent] = []
    for wave, steps in ((requests[0:4], 2), (requests[4:7], 3), (requests[7:12], 1)):
        for request in wave:
            engine.submit(request)
        for _ in range(steps):
            events += engine.step()
    for request in requests[12:]:
        engine.submit(request)
    events += _run_until_idle(engine)
    assert _ids_by_request(events) == {
        r.request_id: solo_ids(model, precision, r) for r in requests}


@PRECISION
@MODELS
def test_seeded_sampling_in_a_mixed_batch_equals_solo(
    model: str, precision: str, make_tiny_engine: Callable[..., Engine], solo_ids: SoloIds
) -> None:
    sampled = [
        _request(f"s{i}", prompt, max_new + 4, params)
        for i, ((prompt, max_new), params) in enumerate(zip(CASES, SEEDED, strict=False))
    ]
    greedy = [_request(f"g{i}", *case) for i, case in enumerate(CASES[4:10])]
    engine = make_tiny_engine(model, precision, **ENGINE_OPTIONS)
    for request in [*sampled[:2], *greedy[:3], *sampled[2:], *greedy[3:]]:
        engine.submit(request)
    got = _ids_by_request(_run_until_idle(engine))
    assert got == {r.request_id: solo_ids(model, precision, r) for r in [*sampled, *greedy]}


@PRECISION
@MODELS
def test_seeded_sampling_actually_samples(model: str, precision: str, solo_ids: SoloIds) -> None:
    # Guards the identity tests above against comparing greedy with greedy.
    differs = [
        solo_ids(model, precision, _request("s", prompt, 12, params))
        != solo_ids(model, precision, _request("s", prompt, 12, GREEDY))
        for (prompt, _), params in zip(CASES, SEEDED, strict=False)
    ]
    assert all(differs)


@MODELS
def test_solo_equals_library_generate(model: str, make_tiny_engine: Callable[..., Engine]) -> None:
    reference = load_model(model, "cpu")  # its own instance: it keeps the library's attention
    reference.model.set_attn_implementation("sdpa")
    engine = make_tiny_engine(model, **ENGINE_OPTIONS)
    for prompt, _ in CASES[:4] + CASES[9:12]:
        ids = reference.tokenizer.encode(prompt)
        expected = reference.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        engine.submit(_request(prompt, prompt, 12))
        assert _ids_by_request(_run_until_idle(engine))[prompt] == expected, prompt


# -- paged attention alone ------------------------------------------------------------------

NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 8, 4
# Block tables deliberately out of order and interleaved between sequences.
TABLES = [[7], [3, 12], [0, 9, 5], [14, 2, 11, 6]]
LENGTHS = [1, 6, 9, 16]  # positions after this decode step, the new one included


def _repeat_kv(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    return x.repeat_interleave(NUM_HEADS // num_kv_heads, dim=1)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Plain attention over one sequence, (1, heads, n, dim) -> (1, n, heads, dim)."""
    num_kv_heads = k.shape[1]
    out = F.scaled_dot_product_attention(
        q, _repeat_kv(k, num_kv_heads), _repeat_kv(v, num_kv_heads), is_causal=causal
    )
    return out.transpose(1, 2)


def _cache(num_kv_heads: int) -> PagedKVCache:
    cache = PagedKVCache(
        num_layers=2,
        num_blocks=16,
        block_size=BLOCK_SIZE,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    cache.fill_for_test(float("nan"))  # allocated unwritten: what is read must be written
    return cache


def _slots(cache: PagedKVCache, table: list[int], positions: range) -> torch.Tensor:
    positions_tensor = torch.tensor([list(positions)], dtype=torch.long)
    return cache.slots(torch.tensor([table]), positions_tensor).flatten()


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_paged_prefill_writes_the_cache_and_matches_causal_sdpa(num_kv_heads: int) -> None:
    generator = torch.Generator().manual_seed(0)
    cache, layer = _cache(num_kv_heads), types.SimpleNamespace(layer_idx=1)
    n, table = 11, TABLES[3]
    q = torch.randn(1, NUM_HEADS, n, HEAD_DIM, generator=generator)
    k, v = (torch.randn(1, num_kv_heads, n, HEAD_DIM, generator=generator) for _ in "kv")
    slots = _slots(cache, table, range(n))
    out, _ = paged_attention(layer, q, k, v, None, paged=PagedBatch(cache, slots))
    torch.testing.assert_close(out, _reference(q, k, v, causal=True))
    torch.testing.assert_close(cache.keys[1][slots], k[0].transpose(0, 1))
    torch.testing.assert_close(cache.values[1][slots], v[0].transpose(0, 1))
    assert torch.isnan(cache.keys[0]).all()  # another layer's cache is untouched


@pytest.mark.parametrize("pad_to", [32, 4], ids=["one-call", "groups"])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_paged_decode_batch_of_different_lengths_matches_sdpa(
    num_kv_heads: int, pad_to: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paged_batch, "PAD_TO", pad_to)  # 4: four length groups
    generator = torch.Generator().manual_seed(1)
    cache, layer = _cache(num_kv_heads), types.SimpleNamespace(layer_idx=0)
    full_k = [torch.randn(1, num_kv_heads, n, HEAD_DIM, generator=generator) for n in LENGTHS]
    full_v = [torch.randn(1, num_kv_heads, n, HEAD_DIM, generator=generator) for n in LENGTHS]
    for table, n, k, v in zip(TABLES, LENGTHS, full_k, full_v, strict=True):
        slots = _slots(cache, table, range(n - 1))  # what earlier steps cached
        cache.keys[0][slots] = k[0, :, : n - 1].transpose(0, 1)
        cache.values[0][slots] = v[0, :, : n - 1].transpose(0, 1)
    width = max(map(len, TABLES))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in TABLES])
    lengths = torch.tensor(LENGTHS)[:, None]
    batch = decode_batch(cache, tables, lengths - 1, torch.float32)
    q = torch.randn(len(LENGTHS), NUM_HEADS, 1, HEAD_DIM, generator=generator)
    new_k = torch.cat([k[:, :, -1:] for k in full_k])
    new_v = torch.cat([v[:, :, -1:] for v in full_v])
    out, _ = paged_attention(layer, q, new_k, new_v, None, paged=batch)
    assert out.shape == (len(LENGTHS), 1, NUM_HEADS, HEAD_DIM)
    for row, (k, v) in enumerate(zip(full_k, full_v, strict=True)):
        expected = _reference(q[row : row + 1], k, v, causal=False)
        torch.testing.assert_close(out[row : row + 1], expected)


def test_decode_rows_are_grouped_by_their_own_padded_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert paged_batch.length_groups(LENGTHS) == [[3, 2], [1, 0]]  # 16, 9 | 6, 1: buckets of 8
    assert paged_batch.length_groups([5, 700, 6, 698]) == [[1, 3], [2, 0]]  # longest first
    monkeypatch.setattr(paged_batch, "PAD_TO", 4)
    assert paged_batch.length_groups(LENGTHS) == [[3], [2], [1], [0]]  # 16 | 12 | 8 | 4
    assert paged_batch.length_groups([7, 5, 8, 6]) == [[2, 0, 3, 1]]  # one bucket of 8


ROWS_ALONE = pytest.mark.parametrize("rows_alone", [False, True], ids=["causal", "rows-alone"])


@ROWS_ALONE
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_packed_prefill_batch_attends_within_each_prompt_and_writes_its_blocks(
    num_kv_heads: int, rows_alone: bool,
) -> None:
    generator = torch.Generator().manual_seed(2)
    cache, layer = _cache(num_kv_heads), types.SimpleNamespace(layer_idx=1)
    lengths, tables = [3, 7, 5], TABLES[:3]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    batch, positions = prefill_batch(cache, padded, lengths, rows_alone=rows_alone)
    assert positions.tolist() == [[*range(3), *range(7), *range(5)]]
    total = sum(lengths)
    q = torch.randn(1, NUM_HEADS, total, HEAD_DIM, generator=generator)
    k, v = (torch.randn(1, num_kv_heads, total, HEAD_DIM, generator=generator) for _ in "kv")
    out, _ = paged_attention(layer, q, k, v, None, paged=batch)
    start = 0
    for table, n in zip(tables, lengths, strict=True):
        part = slice(start, start + n)
        torch.testing.assert_close(
            out[:, part], _reference(q[:, :, part], k[:, :, part], v[:, :, part], causal=True))
        alone, _ = prefill_batch(_cache(num_kv_heads), torch.tensor([table]), [n],
                                 rows_alone=rows_alone)
        solo, _ = paged_attention(layer, q[:, :, part], k[:, :, part], v[:, :, part], None,
                                  paged=alone)
        assert torch.equal(out[:, part], solo)  # the prompt prefilled alone, bit for bit
        slots = _slots(cache, table, range(n))
        assert torch.equal(cache.keys[1][slots], k[0, :, part].transpose(0, 1))
        start += n


@ROWS_ALONE
def test_a_later_chunk_attends_to_its_cached_prefix_and_itself(rows_alone: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    cache, layer = _cache(2), types.SimpleNamespace(layer_idx=0)
    table, n, cut = torch.tensor([TABLES[3]]), 13, 5
    q = torch.randn(1, NUM_HEADS, n, HEAD_DIM, generator=generator)
    k, v = (torch.randn(1, 2, n, HEAD_DIM, generator=generator) for _ in "kv")
    first, _ = prefill_batch(cache, table, [cut], rows_alone=rows_alone)
    paged_attention(layer, q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], None, paged=first)
    second, positions = prefill_batch(cache, table, [n - cut], [cut], rows_alone=rows_alone)
    assert positions.tolist() == [list(range(cut, n))]
    out, _ = paged_attention(layer, q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], None,
                             paged=second)
    torch.testing.assert_close(out, _reference(q, k, v, causal=True)[:, cut:])
    if rows_alone:  # where the prompt was cut changes no bit
        whole, _ = paged_attention(
            layer, q, k, v, None, paged=prefill_batch(_cache(2), table, [n], rows_alone=True)[0])
        assert torch.equal(out, whole[:, cut:])


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
@MODELS
def test_a_prompt_prefilled_in_chunks_gives_the_whole_prefills_logprobs(
    model: str, precision: str, make_tiny_engine: Callable[..., Engine],
) -> None:
    """Where a step's budget cuts a prompt (it depends on what else is waiting, or on a
    step-time target) changes no bit of its answer. (float32's products take another
    path for one row than for many: its chunks may differ in last bits.)"""
    prompt = "The capital of Italy is Rome. The capital of France is Paris. " * 3
    sampling = SamplingParams(ignore_eos=True, logprobs=True, top_logprobs=2)
    found = []
    for budget in (4096, 16, 7):
        engine = make_tiny_engine(model, precision, max_prefill_tokens=budget,
                                  **ENGINE_OPTIONS)
        engine.submit(GenerationRequest("r", prompt, 8, sampling=sampling))
        events = _run_until_idle(engine)
        found.append([e.logprobs for e in events if isinstance(e, TokenEvent)])
    assert len(found[0]) == 8 and found[1] == found[0] and found[2] == found[0]


def test_paged_attention_without_a_batch_raises() -> None:
    x = torch.zeros(1, NUM_HEADS, 1, HEAD_DIM)
    with pytest.raises(RuntimeError, match="paged"):
        paged_attention(types.SimpleNamespace(layer_idx=0), x, x, x, None)

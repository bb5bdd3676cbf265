"""Issue 33, items 3 and 5: what one tenant's small requests may cost or show the others.

Item 3: the forged-turn check is linear (counted in Python line events, not time), the
number of chat messages and text parts is capped (over real HTTP, in each route's
envelope), and chat text surely over the context is refused before the template runs.
Item 5: with ``STREAMSCOPE_MODEL_NAME=*`` the served name is echoed, not the client's;
a keyless server answers only local ``Host`` names; ``/ready``'s Redis ping does not
wait behind the readers' limiter; ``/v1/models`` and ``/stats`` show a model folder's
name, never its path.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import trio

import engine.text
from app.hosts import host_allowed
from engine.engine import Engine
from engine.model import LoadedModel
from engine.text_chat import Pieces, _forged, chat_prompt
from tests.http2_clients import h2_client
from tests.http_server import RecordingEngine, StartServer
from tests.test_input_trust_chat import chatml_model  # noqa: F401 (a fixture)
from tests.test_replicas import RESUME_SECRET, redis_process, redis_url  # noqa: F401
from tests.tls import Certificate

SAFETY_NET_S = 10.0  # fires only if the awaited answer never comes

# -- item 3: the forged-turn check is linear ---------------------------------------------

SPECIAL = frozenset({1})
Case = tuple[list[int], list[tuple[int, int]], Pieces]


def forged(case: Case) -> bool:
    ids, offsets, pieces = case
    return _forged(ids, offsets, SPECIAL, pieces)


def conversation(n: int) -> Case:
    """``n`` messages as the check sees them: ``<S>`` (one special token) then a one-
    character content (one ordinary token), n times; nothing forged, so all is scanned."""
    pieces: Pieces = []
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for k in range(n):
        pieces += [("<S>", False), ("x", True)]
        ids += [1, 2]
        offsets += [(4 * k, 4 * k + 3), (4 * k + 3, 4 * k + 4)]
    return ids, offsets, pieces


def line_events(call: Callable[[], object]) -> int:
    """How many Python lines ``call`` runs (generator expressions' included)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def test_the_forged_turn_check_grows_linearly_with_the_messages() -> None:
    small, large = (conversation(n) for n in (100, 800))

    assert not forged(small) and not forged(large)
    ratio = line_events(lambda: forged(large)) / line_events(lambda: forged(small))

    assert ratio < 10  # linear: about 8; comparing every token with every span: about 64


def brute_forged(ids: list[int], offsets: list[tuple[int, int]], pieces: Pieces) -> bool:
    """The definition: a special token whose span overlaps a content's."""
    spans, at = [], 0
    for piece, is_content in pieces:
        if is_content:
            spans.append((at, at + len(piece)))
        at += len(piece)
    return any(start < span_end and end > span_start
               for token, (start, end) in zip(ids, offsets, strict=True) if token in SPECIAL
               for span_start, span_end in spans)


def random_case(rng: random.Random) -> Case:
    pieces: Pieces = [("ab" * rng.randint(1, 3), rng.random() < 0.5)
                      for _ in range(rng.randint(1, 6))]
    length = sum(len(p) for p, _ in pieces)
    ids, offsets, at = [], [], 0
    while at < length:  # tokens in order, some of them empty (zero-width)
        end = min(length, at + rng.randint(0, 4))
        ids.append(rng.choice((1, 2)))
        offsets.append((at, end))
        at = end if end > at else at + (rng.random() < 0.5)
    return ids, offsets, pieces


def test_the_linear_check_decides_exactly_as_the_definition() -> None:
    rng = random.Random(33)
    for _ in range(3000):
        case = random_case(rng)
        assert forged(case) == brute_forged(*case)


# -- item 3: the caps, over real HTTP ------------------------------------------------------

def chat(messages: int, parts: int = 1) -> dict[str, Any]:
    content: Any = "hi" if parts == 1 else [{"type": "text", "text": "hi"}] * parts
    turns = [{"role": "user", "content": content}] * messages
    return {"model": "tiny", "max_tokens": 1, "messages": turns}


@pytest.mark.parametrize(("messages", "parts", "named"), [(5, 1, "5 messages"),
                                                          (1, 7, "7 text parts")])
async def test_chat_caps_are_refused_in_each_routes_envelope(
    start_server: StartServer, messages: int, parts: int, named: str,
) -> None:
    server = await start_server(model_name="tiny", max_chat_messages=4, max_content_parts=6)
    body = chat(messages, parts)
    async with server.client() as client:
        openai = await client.post("/v1/chat/completions", json=body)
        anthropic = await client.post("/v1/messages", json=body)
        count = await client.post("/v1/messages/count_tokens",
                                  json={"model": "tiny", "messages": body["messages"]})

    for answer in (openai, anthropic, count):
        assert answer.status_code == 400, answer.text
    error = openai.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert named in error["message"]
    for answer in (anthropic, count):
        assert answer.status_code == 400, answer.text
        assert answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert named in answer.json()["error"]["message"]
    assert server.recorder.submitted == []


async def test_a_system_prompt_counts_as_a_message_for_anthropic(
    start_server: StartServer,
) -> None:
    server = await start_server(model_name="tiny", max_chat_messages=4)
    body = {**chat(4), "system": "be brief"}
    async with server.client() as client:
        answer = await client.post("/v1/messages/count_tokens",
                                   json={k: body[k] for k in ("model", "messages", "system")})

    assert answer.status_code == 400 and "5 messages" in answer.text


async def test_chat_text_surely_over_the_context_is_refused_before_the_template(
    start_server: StartServer, chatml_model: LoadedModel,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rendered: list[int] = []  # the messages of each chat template run

    def counted(tokenizer: Any, messages: Any, add_generation_prompt: bool,
                tools: Any = None) -> Any:
        rendered.append(len(messages))
        return chat_prompt(tokenizer, messages, add_generation_prompt, tools)

    monkeypatch.setattr(engine.text, "chat_prompt", counted)

    def make_engine(s: Any) -> RecordingEngine:
        return RecordingEngine(Engine(chatml_model, max_batch=s.max_batch,
                                      num_blocks=s.cache_blocks, block_size=s.block_size))

    server = await start_server(make_engine=make_engine, model_name="tiny",
                                max_prompt_chars=20_000, max_body_bytes=32_768)
    context = chatml_model.max_context
    words = "word " * (context * 3)  # every 5 characters a token at least: 3x the context
    async with server.client() as client:
        over = await client.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": words}]})
        tokens = await client.post("/v1/messages/count_tokens", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x" * 20 * context}]})
        fine = await client.post("/v1/messages/count_tokens", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello"}]})

    assert over.status_code == 400 and over.json()["error"]["code"] == "prompt_too_long"
    assert tokens.status_code == 400 and "at least" in tokens.json()["error"]["message"]
    assert fine.status_code == 200, fine.text
    assert rendered == [1]  # only the short one reached the template


# -- item 5a: the served model's name, never the client's string ----------------------------

async def test_any_model_under_star_is_answered_with_the_served_name(
    start_server: StartServer,
) -> None:
    server = await start_server(model_name="*", max_body_bytes=65_536)
    asked = "m" * 30_000
    async with server.client() as client:
        whole = await client.post("/v1/completions", json={
            "model": asked, "prompt": "Hi", "max_tokens": 2})
        streamed = await client.post("/v1/completions", json={
            "model": asked, "prompt": "Hi", "max_tokens": 2, "stream": True})
        card = await client.get(f"/v1/models/{'m' * 2000}")

    assert whole.status_code == 200 and whole.json()["model"] == "tiny-gpt2"
    assert streamed.status_code == 200 and asked not in streamed.text
    assert '"model": "tiny-gpt2"' in streamed.text or '"model":"tiny-gpt2"' in streamed.text
    assert card.status_code == 200 and card.json()["id"] == "tiny-gpt2"


# -- item 5b: a keyless server answers local Host names only --------------------------------

@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1:1",
                                  "[::1]:8080", "LOCALHOST"])
async def test_a_keyless_server_answers_local_hosts(start_server: StartServer,
                                                    host: str) -> None:
    server = await start_server()
    async with server.client() as client:
        answer = await client.get("/v1/models", headers={"Host": host})
    assert answer.status_code == 200, answer.text


async def test_a_keyless_server_refuses_another_host_but_its_probes(
    start_server: StartServer,
) -> None:
    server = await start_server(allowed_hosts=frozenset({"proxy.example"}))
    async with server.client() as client:
        evil = await client.post("/v1/generate", headers={"Host": "evil.example"},
                                 json={"prompt": "Hi", "max_new_tokens": 1})
        openai = await client.get("/v1/models", headers={"Host": "evil.example:80"})
        proxy = await client.get("/v1/models", headers={"Host": "proxy.example:443"})
        health = await client.get("/health", headers={"Host": "10.0.0.7:8000"})

    assert evil.status_code == 400 and evil.json()["error"]["type"] == "bad_request"
    assert "evil.example" in evil.json()["error"]["message"]
    assert openai.status_code == 400  # in the OpenAI routes' shape
    assert openai.json()["error"]["type"] == "invalid_request_error"
    assert proxy.status_code == 200 and health.status_code == 200
    assert server.recorder.submitted == []


@pytest.mark.parametrize(("host", "allowed"), [
    ("localhost", True), ("127.0.0.1:8000", True), ("[::1]", True), ("[::1]:1", True),
    ("proxy.example", True), ("proxy.example:443", True), ("other.example:8443", True),
    ("", False), ("  ", False), ("localhost.evil.example", False), ("127.0.0.1.nip.io", False),
    ("[::1]evil.example", False), ("localhost:80:80", False), ("other.example", False),
    ("evil.example:443", False), ("[::2]", False),
])
def test_which_hosts_a_keyless_server_answers(host: str, allowed: bool) -> None:
    extra = frozenset({"proxy.example", "other.example:8443"})
    assert host_allowed(host, extra) is allowed


async def test_http2_authority_is_checked_as_host(
    start_tls: StartServer, certificate: Certificate,
) -> None:
    server = await start_tls()
    async with h2_client(server, certificate) as client:
        local = await client.get("/v1/models")
        evil = await client.get("/v1/models", headers={"Host": "evil.example"})

    assert local.http_version == evil.http_version == "HTTP/2"
    assert local.status_code == 200
    assert evil.status_code == 400 and "evil.example" in evil.text


async def test_a_server_with_a_key_answers_any_host(start_server: StartServer) -> None:
    key = "k" * 40
    server = await start_server(api_key=key)
    async with server.client() as client:
        answer = await client.get("/v1/models", headers={
            "Host": "api.example", "Authorization": f"Bearer {key}"})
    assert answer.status_code == 200


# -- item 5c: /ready's ping has its own connection and limiter -------------------------------

async def test_ready_answers_while_the_readers_limiter_is_exhausted(
    start_server: StartServer, redis_url: str,  # noqa: F811
) -> None:
    server = await start_server(resume_store=redis_url, resume_secret=RESUME_SECRET)
    registry = server.app.runtime.resumption
    assert registry is not None and registry._shared is not None
    limiter: trio.CapacityLimiter = registry._shared._read_limiter  # type: ignore[attr-defined]
    holders = [object() for _ in range(int(limiter.total_tokens))]
    for holder in holders:
        limiter.acquire_on_behalf_of_nowait(holder)
    try:
        async with server.client() as client:
            with trio.fail_after(SAFETY_NET_S):
                ready = await client.get("/ready")
    finally:
        for holder in holders:
            limiter.release_on_behalf_of(holder)

    assert limiter.available_tokens == limiter.total_tokens
    assert ready.status_code == 200, ready.text


# -- item 5e: a model folder's name, never its path -------------------------------------------

@pytest.fixture
def model_folder(tmp_path: Path) -> Iterator[str]:
    folder = tmp_path / "secret-place" / "my-model"
    folder.mkdir(parents=True)
    yield str(folder)


async def test_models_and_stats_show_a_folders_name_not_its_path(
    start_server: StartServer, model_folder: str,
) -> None:
    server = await start_server(model=model_folder)
    async with server.client() as client:
        models = await client.get("/v1/models")
        stats = await client.get("/stats")
        by_path = await client.post("/v1/completions", json={
            "model": model_folder, "prompt": "Hi", "max_tokens": 1})

    assert [m["id"] for m in models.json()["data"]] == ["my-model"]
    assert stats.json()["model"] == "my-model"
    for answer in (models, stats, by_path):
        assert "secret-place" not in answer.text
    assert by_path.json()["model"] == "my-model"

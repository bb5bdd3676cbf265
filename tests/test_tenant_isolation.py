"""Tenants apart (issue 33 item 1): one API key learns nothing of another's prompts.

Key B sends a long prompt P; then key A probes it three ways, as the issue measured:
A's own P finds nothing cached (the engine's counters), a 429 ``deadline_unmeetable``
for P reads exactly as one for a fresh prompt of the same length, and ``/metrics``
without a credential shows no prefix-cache series (with ``STREAMSCOPE_METRICS_TOKEN``
it refuses). Requests of one key still share, and ``cache_salt`` splits within a key.
The shipped proxy configs answer ``/metrics`` and ``/stats`` with 404. Real HTTP over
loopback, the tiny GPT-2 with a ChatML template (the chat route gives the deadline check
the prompt's ids at once), its prefix cache on.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.settings import Settings, SettingsError
from engine import GenerationRequest, SamplingParams
from tests.http_clients import parse_sse
from tests.http_server import RecordingEngine, RunningServer, StartServer
from tests.test_nginx import Nginx, deploy_conf, nginx  # noqa: F401 (a fixture)
from tests.test_openai_sdk import with_chat_template
from tests.test_replicas import haproxy, wait_ready_through  # noqa: F401 (a fixture)

if TYPE_CHECKING:
    from engine.model import LoadedModel

KEY_A = "sk-tenant-a-0123456789abcdefghijklmnop"
KEY_B = "sk-tenant-b-0123456789abcdefghijklmnop"
METRICS_TOKEN = "scrape-0123456789abcdefghijklmnopqrst"
KEYS = [{"name": "a", "key": KEY_A}, {"name": "b", "key": KEY_B}]
PROMPT_CHARS = 200  # each one token: the rendered prompt is some 210 tokens, 13 blocks
PREFIX_SERIES = ("streamscope_prefix_cache_hits", "streamscope_prefix_cache_queries",
                 "streamscope_kv_cache_blocks_cached", "streamscope_kv_cache_blocks_evicted",
                 "streamscope_kv_cache_blocks_filled")


@pytest.fixture
def chat_model(tiny_model: Callable[[str], LoadedModel]) -> LoadedModel:
    return with_chat_template(tiny_model("tiny-gpt2"))


@pytest.fixture
def words(chat_model: LoadedModel) -> tuple[str, str]:
    """Two prompts of PROMPT_CHARS one-token characters each, from two alphabets no pair
    of which merges: P and a fresh F, rendered to the same number of tokens."""
    tokenizer = chat_model.tokenizer
    alphabet: list[str] = []
    for c in string.ascii_letters + string.digits:
        pairs = [c + c] + [x + c for x in alphabet] + [c + x for x in alphabet]
        if len(tokenizer.encode(c)) == 1 and all(len(tokenizer.encode(p)) == 2 for p in pairs):
            alphabet.append(c)
    assert len(alphabet) >= 8, alphabet
    rng = random.Random(33)
    half = len(alphabet) // 2
    p = "".join(rng.choice(alphabet[:half]) for _ in range(PROMPT_CHARS))
    f = "".join(rng.choice(alphabet[half:2 * half]) for _ in range(PROMPT_CHARS))
    rendered = [len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)))
        for text in (p, f)]
    assert rendered[0] == rendered[1] >= PROMPT_CHARS, rendered
    return p, f


async def start(start_server: StartServer, chat_model: LoadedModel,
                **settings: Any) -> RunningServer:
    """A server with the two keys (unless told otherwise) and its prefix cache on."""
    from engine.engine import Engine  # tests may use engine internals; app may not

    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(chat_model, max_batch=s.max_batch,
                                      num_blocks=s.cache_blocks, block_size=s.block_size,
                                      prefix_cache=True))

    return await start_server(make_engine=make_engine, model_name="tiny",
                              **{"api_keys": KEYS, **settings})


async def chat(server: RunningServer, key: str | None, content: str,
               **fields: Any) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with server.client() as client:
        return await client.post("/v1/chat/completions", headers=headers, json={
            "model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, "temperature": 0, **fields})


async def hits_of(server: RunningServer, key: str | None, content: str,
                  **fields: Any) -> int:
    """Prompt positions the request found cached (the engine's counter, before/after),
    which its usage tells the key as ``cached_tokens``."""
    before = server.recorder.statistics().prefix_cache_hits
    response = await chat(server, key, content, **fields)
    assert response.status_code == 200, response.text
    await server.wait_for(lambda: server.hub.statistics().streams_open == 0, "the stream to end")
    hits = server.recorder.statistics().prefix_cache_hits - before
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": hits}
    return hits


async def test_another_keys_prompt_is_never_found_cached(
    start_server: StartServer, chat_model: LoadedModel, words: tuple[str, str],
) -> None:
    server = await start(start_server, chat_model)
    p, _ = words
    assert await hits_of(server, KEY_B, p) == 0  # cold
    assert await hits_of(server, KEY_A, p) == 0  # B's blocks are not A's
    assert await hits_of(server, KEY_A, p) >= (PROMPT_CHARS // 16) * 16  # A's own are
    assert await hits_of(server, KEY_B, p) >= (PROMPT_CHARS // 16) * 16  # and B's still


async def test_cache_salt_splits_a_keys_cache_and_the_same_salt_shares(
    start_server: StartServer, chat_model: LoadedModel, words: tuple[str, str],
) -> None:
    server = await start(start_server, chat_model)
    p, _ = words
    assert await hits_of(server, KEY_A, p, cache_salt="alice") == 0
    assert await hits_of(server, KEY_A, p, cache_salt="bob") == 0
    assert await hits_of(server, KEY_A, p) == 0  # no salt: a namespace of its own
    assert await hits_of(server, KEY_A, p, cache_salt="alice") > 0
    assert await hits_of(server, KEY_B, p, cache_salt="alice") == 0  # the salt is per key


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages", "/v1/stream"])
async def test_every_route_takes_cache_salt(
    start_server: StartServer, chat_model: LoadedModel, words: tuple[str, str], path: str,
) -> None:
    server = await start(start_server, chat_model)
    p, _ = words

    def reported(response: httpx.Response) -> int:
        """The cached tokens the route's own usage reports."""
        if path == "/v1/messages":
            return int(response.json()["usage"]["cache_read_input_tokens"])
        if path == "/v1/completions":
            return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        done = [e for e in parse_sse(response.content) if e.event == "done"]
        return int(json.loads(done[0].data)["usage"]["cached_tokens"])

    async def hits(salt: str) -> int:
        before = server.recorder.statistics().prefix_cache_hits
        body: dict[str, Any] = {"max_tokens": 2, "cache_salt": salt, "model": "tiny"}
        if path == "/v1/messages":
            body["messages"] = [{"role": "user", "content": p}]
        elif path == "/v1/completions":
            body["prompt"] = p
        else:
            body = {"prompt": p, "max_new_tokens": 2, "cache_salt": salt}
        async with server.client() as client:
            response = await client.post(path, json=body,
                                         headers={"Authorization": f"Bearer {KEY_A}"})
        assert response.status_code == 200, response.text
        await server.wait_for(lambda: server.hub.statistics().streams_open == 0,
                              "the stream to end")
        found = server.recorder.statistics().prefix_cache_hits - before
        assert reported(response) == found
        return found

    assert await hits("one") == 0
    assert await hits("two") == 0
    assert await hits("one") > 0


async def test_the_keyless_server_still_shares_between_its_requests(
    start_server: StartServer, chat_model: LoadedModel, words: tuple[str, str],
) -> None:
    server = await start(start_server, chat_model, api_keys=())
    p, _ = words
    assert await hits_of(server, None, p) == 0
    assert await hits_of(server, None, p) > 0


@pytest.mark.parametrize("salt", ["", "x" * 65, "caf\u00e9", "tab\there"],
                         ids=["empty", "too-long", "not-ascii", "control"])
async def test_a_bad_cache_salt_is_refused_before_the_stream(
    start_server: StartServer, chat_model: LoadedModel, salt: str,
) -> None:
    server = await start(start_server, chat_model, api_keys=())
    async with server.client() as client:
        native = await client.post("/v1/stream", json={"prompt": "Hi", "cache_salt": salt})
    chat_answer = await chat(server, None, "Hi", cache_salt=salt)
    for response, status in ((native, 422), (chat_answer, 400)):  # each route's shape
        assert response.status_code == status, response.text
        assert "cache_salt" in response.text
    assert server.hub.statistics().opened == 0


async def test_a_refused_deadline_reads_the_same_for_another_keys_prompt_and_a_fresh_one(
    start_server: StartServer, chat_model: LoadedModel, words: tuple[str, str],
) -> None:
    server = await start(start_server, chat_model)
    p, f = words
    assert await hits_of(server, KEY_B, p) == 0  # P is cached, for B; steps are measured
    answers = [await chat(server, KEY_A, prompt, deadline_ms=0.001) for prompt in (p, f)]
    for response in answers:
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "deadline_unmeetable"
        assert "estimate_ms" not in response.json()["error"]
    cached, fresh = answers
    assert cached.json() == fresh.json()
    assert cached.headers["Retry-After"] == fresh.headers["Retry-After"]
    assert server.hub.statistics().refused_deadline == 2


def test_the_estimate_counts_only_the_namespaces_own_cached_blocks(
    make_tiny_engine: Callable[..., Any],
) -> None:
    engine = make_tiny_engine(num_blocks=64, block_size=4, prefix_cache=True)
    ids = tuple(random.Random(7).randrange(1, 300) for _ in range(40))
    engine.submit(GenerationRequest("b", "", 2, sampling=SamplingParams(ignore_eos=True),
                                    prompt_token_ids=ids, cache_namespace=b"B" * 32))
    while engine.has_work():
        engine.step()
    cold = engine.estimate_ttft_ms(len(ids))  # nothing of it counted as cached
    assert cold is not None
    assert engine.estimate_ttft_ms(len(ids), ids, b"A" * 32) == cold
    warm = engine.estimate_ttft_ms(len(ids), ids, b"B" * 32)
    assert warm is not None and warm < cold


def scrape_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


async def test_open_metrics_leave_out_the_prefix_cache_series(
    start_server: StartServer, chat_model: LoadedModel, words: tuple[str, str],
) -> None:
    server = await start(start_server, chat_model)
    p, _ = words
    await hits_of(server, KEY_B, p)
    assert await hits_of(server, KEY_B, p) > 0  # there is something to hide
    async with server.client() as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    names = scrape_names(response.text)
    assert "streamscope_requests_finished" in names  # the load figures stay
    assert not names & set(PREFIX_SERIES), names & set(PREFIX_SERIES)


async def test_with_a_metrics_token_metrics_need_it_and_show_everything(
    start_server: StartServer, chat_model: LoadedModel, words: tuple[str, str],
) -> None:
    server = await start(start_server, chat_model, metrics_token=METRICS_TOKEN)
    await hits_of(server, KEY_B, words[0])
    async with server.client() as client:
        refused = [await client.get("/metrics", headers=headers) for headers in (
            {}, {"Authorization": f"Bearer {KEY_A}"},
            {"Authorization": f"Bearer {METRICS_TOKEN}x"})]
        allowed = await client.get("/metrics",
                                   headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    for response in refused:
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "unauthorized"
        assert "prefix_cache" not in response.text
    assert allowed.status_code == 200
    assert set(PREFIX_SERIES) <= scrape_names(allowed.text)


PRIVATE_PATHS = ["/metrics", "/stats", "//metrics", "/./stats", "/%6Detrics", "/stats/"]


async def test_deploy_nginx_conf_answers_metrics_and_stats_with_404(
    start_server: StartServer, nginx: Nginx,  # noqa: F811 (the imported fixture)
) -> None:
    a, b = await start_server(), await start_server()
    url = await nginx(deploy_conf(), a, b)
    await _expect_private(url)


async def test_deploy_haproxy_cfg_answers_metrics_and_stats_with_404(
    start_server: StartServer,
    haproxy: Callable[[RunningServer, RunningServer], str],  # noqa: F811 (the fixture)
) -> None:
    a, b = await start_server(), await start_server()
    url = haproxy(a, b)
    await wait_ready_through(url)
    await _expect_private(url)


async def _expect_private(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        assert (await client.get("/health")).status_code == 200  # the rest passes
        for path in PRIVATE_PATHS:
            response = await client.get(httpx.URL(url + path))
            assert response.status_code == 404, (path, response.text)
            assert "streamscope_" not in response.text and "blocks" not in response.text


def test_a_short_metrics_token_stops_the_server_and_is_never_echoed() -> None:
    short = "scrape-me-" + "9" * 10
    with pytest.raises(SettingsError, match="STREAMSCOPE_METRICS_TOKEN") as caught:
        Settings.from_env({"STREAMSCOPE_METRICS_TOKEN": short})
    assert short not in str(caught.value)
    assert METRICS_TOKEN not in repr(Settings(metrics_token=METRICS_TOKEN))

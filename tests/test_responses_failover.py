"""A background response whose replica is killed resumes through the balancer (issue 36).

Real processes, as ``test_failover.py``: a ``redis-server``, two ``streamscope serve``
replicas sharing it and HAProxy in front (``deploy/haproxy.cfg``). The replicas serve
the tiny GPT-2 saved to a folder with a ChatML template (the Responses API renders a
chat). A client creates a background response through the balancer with ``stream:
true`` and reads some events; the replica generating it gets SIGKILL; the client
resumes through the balancer with ``GET /v1/responses/<id>?stream=true&starting_after=N``
(again after a body that ends without the final event, as the SDK's user would) until
the final event. Every sequence number comes once, and the text is that of an
uninterrupted run of the same request. Missing ``redis-server`` or ``haproxy`` FAILS the
test with the command that installs it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from streams import ServerSentEvent, SSEParser
from tests.test_failover import SETTINGS, WAIT_S, replicas, stats, wait_whole
from tests.test_openai_sdk import CHATML
from tests.test_replicas import (  # noqa: F401 (redis_process, redis_url: fixtures)
    DEPLOY,
    binary,
    redis_process,
    redis_url,
)
from tools.cluster import Replica, free_port

TOKENS = 300
REQUEST: dict[str, Any] = {"model": "tiny", "input": "A replica dies and",
                           "max_output_tokens": TOKENS, "temperature": 0}
CUT_AT = 12  # events read before the kill


@pytest.fixture
def chat_model(tmp_path: Path) -> Path:
    """The tiny GPT-2 and its tokenizer, with a ChatML template, saved to a folder."""
    from engine.model import tiny_gpt2, tiny_tokenizer

    folder = tmp_path / "tiny-chat"
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHATML
    tiny_gpt2().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def balancer() -> Iterator[Any]:
    processes: list[subprocess.Popen[bytes]] = []

    def start(a: Replica, b: Replica) -> str:
        port = free_port()
        env = {**os.environ, "STREAMSCOPE_LB_BIND": f"127.0.0.1:{port}",
               "STREAMSCOPE_LB_REPLICA_A": f"127.0.0.1:{a.port}",
               "STREAMSCOPE_LB_REPLICA_B": f"127.0.0.1:{b.port}"}
        processes.append(subprocess.Popen(
            [binary("haproxy", "haproxy"), "-db", "-f", os.path.join(DEPLOY, "haproxy.cfg")],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return f"http://127.0.0.1:{port}"

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


def client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False, verify=False)


def bodies(events: list[ServerSentEvent]) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in events]


async def wait_both_up(url: str) -> None:
    """Until the balancer sends requests on (its health checks passed)."""
    async with client(url) as http:
        with trio.fail_after(WAIT_S):
            while True:
                try:
                    if (await http.get("/ready")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)


async def read_until_cut(url: str, out: list[dict[str, Any]], cut: trio.Event) -> None:
    """Create the background response and read its events until the connection
    breaks; ``cut`` is set once ``CUT_AT`` events came."""
    parser = SSEParser()
    async with client(url) as http:
        try:
            async with http.stream("POST", "/v1/responses",
                                   json={**REQUEST, "background": True,
                                         "stream": True}) as response:
                assert response.status_code == 200, await response.aread()
                async for chunk in response.aiter_bytes():
                    out += bodies(parser.feed(chunk))
                    if len(out) >= CUT_AT:
                        cut.set()
        except httpx.HTTPError:
            pass  # the replica died


async def resume_until_final(url: str, response_id: str, after: int) -> list[dict[str, Any]]:
    """Read the response through the balancer after ``after``, again after a body
    that ended without the final event (or a refusal while the balancer still tries
    the dead replica), until the final event."""
    got: list[dict[str, Any]] = []
    async with client(url) as http:
        with trio.fail_after(WAIT_S):
            while True:
                try:
                    response = await http.get(
                        f"/v1/responses/{response_id}",
                        params={"stream": "true", "starting_after": str(after)})
                except httpx.TransportError:
                    response = None
                if response is not None and response.status_code == 200:
                    events = bodies(SSEParser().feed(response.content))
                    got += events
                    if events:
                        after = events[-1]["sequence_number"]
                        if events[-1]["type"] in ("response.completed",
                                                  "response.incomplete", "response.failed"):
                            return got
                await trio.sleep(0.1)


async def test_a_background_response_resumes_through_the_balancer_after_its_replica_dies(
    redis_url: str, tmp_path: Path, chat_model: Path, balancer: Any,  # noqa: F811
) -> None:
    settings = {**SETTINGS, "model": str(chat_model), "model_name": "tiny",
                "max_new_tokens_limit": TOKENS}
    first: list[dict[str, Any]] = []
    async with replicas("ab", redis_url, tmp_path, **settings) as (a, b):
        url = balancer(a, b)
        await wait_both_up(url)
        cut = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_until_cut, url, first, cut)
            with trio.fail_after(WAIT_S):
                await cut.wait()
            owner = a if (await stats(a))["resumable_streams"] else b
            owner.kill()
        survivor = b if owner is a else a
        response_id = first[0]["response"]["id"]
        rest = await resume_until_final(url, response_id, first[-1]["sequence_number"])
        async with client(survivor.url) as http:
            stored = (await http.get(f"/v1/responses/{response_id}")).json()
            whole = (await http.post("/v1/responses", json=REQUEST)).json()
        after = await wait_whole(survivor)

    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["response"]["status"] == whole["status"]
    assert text == whole["output"][0]["content"][0]["text"]
    assert stored["status"] == whole["status"]
    assert stored["output"][0]["content"][0]["text"] == text
    assert after["resume_failovers"] == 1

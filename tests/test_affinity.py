"""Conversations stay where their cache is (issue 47, items 1, 2 and 5): three replicas
behind a real HAProxy running ``deploy/haproxy.cfg`` as shipped.

A conversation's key (the ``X-Session-ID`` header, OpenAI's ``prompt_cache_key``,
``user``, Anthropic's ``metadata.user_id``) sends every turn to one replica; a Responses
turn follows its ``previous_response_id`` to the replica that made it (without a shared
store, any other replica answers it 404: the test that the stickiness is real); a request
without a key goes by least connections; when a replica dies only its keys move, each to
one other replica. Every answer names its replica (``Streamscope-Replica``).

The replicas are in-process hypercorn servers on the tiny model with a chat template;
HAProxy's health checks (every second) are waited for through its admin socket.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from app.settings import Settings
from app.settings_env import PROXY_PREFIX, env_name
from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.test_replicas import DEPLOY, binary, free_port
from tests.test_responses_sdk import MODEL, serve

REPLICA = "streamscope-replica"
POOL_TIMEOUT_S = 60.0  # HAProxy checks /ready every second; a busy machine is slow
SESSIONS = [f"conversation-{n}" for n in range(9)]
TURNS = 3

Proxy = Callable[[list[RunningServer]], Awaitable[str]]


@pytest.fixture
async def haproxy(tmp_path: Path) -> AsyncIterator[Proxy]:
    """``await start(replicas)``: deploy/haproxy.cfg in front of ``replicas`` (servers a,
    b, c, ...), with an admin socket; its base URL once every replica is UP."""
    processes: list[trio.Process] = []

    async def start(replicas: list[RunningServer]) -> str:
        port, admin = free_port(), tmp_path / "haproxy.sock"
        extra = tmp_path / "admin.cfg"
        extra.write_text(f"global\n    stats socket {admin} mode 600 level admin\n")
        env = {**os.environ, "STREAMSCOPE_LB_BIND": f"127.0.0.1:{port}",
               **{f"STREAMSCOPE_LB_REPLICA_{letter}": f"{r.host}:{r.port}"
                  for letter, r in zip("ABCDEFGH", replicas, strict=False)}}
        processes.append(await trio.lowlevel.open_process(
            [binary("haproxy", "haproxy"), "-db", "-f", os.path.join(DEPLOY, "haproxy.cfg"),
             "-f", str(extra)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        await wait_states(admin, {letter: "UP" for letter in "abcdefgh"[:len(replicas)]})
        return f"http://127.0.0.1:{port}"

    yield start
    for process in processes:
        process.terminate()
        with trio.fail_after(POOL_TIMEOUT_S):
            await process.wait()


async def server_states(admin: Path) -> dict[str, str]:
    """HAProxy's status of each server of backend ``replicas`` ("UP", "DOWN", ...)."""
    stream = await trio.open_unix_socket(str(admin))
    async with stream:
        await stream.send_all(b"show stat\n")
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    states = {}
    for line in data.decode().splitlines():
        fields = line.split(",")
        if len(fields) > 17 and fields[0] == "replicas" and fields[1] not in ("BACKEND",
                                                                             "FRONTEND"):
            states[fields[1]] = fields[17]
    return states


async def wait_states(admin: Path, want: dict[str, str]) -> None:
    with trio.fail_after(POOL_TIMEOUT_S):
        while True:  # HAProxy's health checks come with no event to wait on
            try:
                states = await server_states(admin)
            except OSError:  # HAProxy has not opened its socket yet
                states = {}
            if all(states.get(name) == state for name, state in want.items()):
                return
            await trio.sleep(0.1)


async def three_replicas(start_server: StartServer,
                         tiny_model: Callable[[str], LoadedModel]) -> list[RunningServer]:
    return [await serve(start_server, tiny_model) for _ in range(3)]


async def replica_of(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> str:
    response = await client.post(path, json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.headers[REPLICA]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, **fields}


async def test_turns_with_one_key_land_on_one_replica_whichever_key_names_it(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], haproxy: Proxy,
) -> None:
    url = await haproxy(await three_replicas(start_server, tiny_model))
    anthropic = {"model": MODEL, "max_tokens": 2,
                 "messages": [{"role": "user", "content": "Hello"}]}
    ways: list[Callable[[str], tuple[str, dict[str, Any], dict[str, str]]]] = [
        lambda key: ("/v1/completions", completion(), {"x-session-id": key}),
        lambda key: ("/v1/completions", completion(prompt_cache_key=key), {}),
        lambda key: ("/v1/completions", completion(user=key), {}),
        lambda key: ("/v1/messages", {**anthropic, "metadata": {"user_id": key}}, {}),
    ]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for way in ways:
            placed: dict[str, set[str]] = {}
            for key in SESSIONS:
                for _ in range(TURNS):
                    path, body, headers = way(key)
                    placed.setdefault(key, set()).add(
                        await replica_of(client, path, body, headers))
            assert all(len(replicas) == 1 for replicas in placed.values()), (way, placed)
            # Consistent hashing spreads the keys: nine keys on one replica would be
            # (1/3)^8 by chance, and the same every run (the ring is a function of the
            # servers' names).
            assert len(set().union(*placed.values())) >= 2, placed


async def test_a_request_without_a_key_goes_by_least_connections(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], haproxy: Proxy,
) -> None:
    url = await haproxy(await three_replicas(start_server, tiny_model))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        seen = {await replica_of(client, "/v1/completions", completion()) for _ in range(6)}

    assert seen == {"a", "b", "c"}  # idle replicas tie: HAProxy takes them in turn


async def test_a_responses_turn_follows_its_previous_response_to_its_replica(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], haproxy: Proxy,
) -> None:
    # Each replica stores its responses in its own memory: a turn sent anywhere else
    # than where its previous response was made is answered 404.
    url = await haproxy(await three_replicas(start_server, tiny_model))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(4):
            previous, replicas = None, set()
            for turn in range(TURNS):
                response = await client.post("/v1/responses", json={
                    "model": MODEL, "input": f"turn {turn}", "max_output_tokens": 2,
                    **({"previous_response_id": previous} if previous else {})})
                assert response.status_code == 200, response.text
                previous = response.json()["id"]
                assert response.headers["streamscope-response-id"] == previous
                replicas.add(response.headers[REPLICA])
            assert len(replicas) == 1


async def test_when_a_replica_dies_only_its_keys_move_each_to_one_other(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], haproxy: Proxy,
    tmp_path: Path,
) -> None:
    replicas = await three_replicas(start_server, tiny_model)
    url = await haproxy(replicas)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def placement() -> dict[str, str]:
            return {key: await replica_of(client, "/v1/completions", completion(),
                                          {"x-session-id": key}) for key in SESSIONS}

        before = await placement()
        victim = before[SESSIONS[0]]
        dead = replicas["abc".index(victim)]
        dead.stop()
        await dead.wait_stopped()
        await wait_states(tmp_path / "haproxy.sock", {victim: "DOWN"})
        after, again = await placement(), await placement()

    assert after == again  # each moved key stays where it moved
    for key, replica in before.items():
        if replica == victim:
            assert after[key] != victim
        else:
            assert after[key] == replica, key  # the others' keys did not move


def test_the_proxy_s_variables_do_not_stop_a_replica() -> None:
    # An operator exports the proxy's variables in the shell that starts the replicas.
    settings = Settings.from_env({"STREAMSCOPE_LB_REPLICA_A": "127.0.0.1:8001",
                                  "STREAMSCOPE_LB_BIND": "127.0.0.1:8080"})
    assert settings == Settings.from_env({})
    assert not any(env_name(name).startswith(PROXY_PREFIX) for name in Settings.model_fields)

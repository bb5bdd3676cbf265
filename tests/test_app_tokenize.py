"""Prompts are encoded off the event loop, never with the tokenizer the step uses.

A stress test over real HTTP: while streams decode (the step thread detokenizing all the
time), bursts of clients post long prompts (96k characters: about 70 ms each to encode
here) and medium ones. No request errs, the budget check still refuses the
long ones (422 ``prompt_too_long``; ``/v1/completions`` in OpenAI's shape) before any
stream opens, and the event loop never stalls: a heartbeat task that sleeps
``HEARTBEAT_S`` at a time is never late by as much as ``STALL_SHARE`` of one long
prompt's encode, timed on this machine before the load. This test measures real time on
purpose, for a few seconds; the bound scales with the machine's speed.

Encoded on the event loop, one such prompt held it for 100-300 ms here; and before the
server froze its heap after loading (``gc.freeze``), one full garbage collection held it
for 0.3-0.5 s. The clients share the server's event loop, so they use one httpx client made
before the measurement.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
import trio

from engine.model import TINY_CORPUS
from streams import HubState
from tests.http_clients import count_tokens, parse_sse, stream_body
from tests.http_server import StartServer

# Three times the production limits (32k characters, 64 KiB), as an operator may set them:
# encoding such a prompt takes about 100 ms, so on the event loop it would stall it on
# any machine (a 32k one: 15-60 ms, with the machine's load).
MAX_PROMPT_CHARS = 3 * 32_768
MAX_BODY_BYTES = 3 * 64 * 1024
CACHE_BLOCKS = 256  # of 16 positions: room for the streams and the medium prompts at once
# A pasted table of 96k characters, about 94k tokens (over the context).
LONG_PROMPT = "".join(f"{i},{i * 7 % 100},x\n" for i in range(30_000))[:96_000]
MEDIUM_PROMPT = " ".join(TINY_CORPUS)[:600]  # about 300 tokens: accepted
ROUNDS = 3  # of CLIENTS requests at once
CLIENTS = 8  # each round: 6 long prompts and 2 medium ones, over the three routes
STREAMS = 3
STREAM_TOKENS = 64  # a stream's; each of the STREAMS opens another until the rounds end
HEARTBEAT_S = 0.005
# The stall allowed, as a share of one LONG_PROMPT encode (the fastest of ENCODES timed
# here first): a prompt encoded on the loop stalls it for a whole encode at least, on any
# machine. The worst lateness seen here is a fifth of an encode on an idle machine and
# half of one with both cores busy with other work (stress-ng).
STALL_SHARE = 0.7
ENCODES = 3


async def heartbeat(lateness: list[tuple[float, float]]) -> None:
    """Sleep HEARTBEAT_S again and again; record how late each wake-up was, and the CPU
    time the event loop's thread spent meanwhile (work on the loop, as opposed to the
    machine's other load or a worker thread holding the GIL)."""
    while True:
        before, cpu_before = trio.current_time(), time.thread_time()
        await trio.sleep(HEARTBEAT_S)
        late = trio.current_time() - before - HEARTBEAT_S
        lateness.append((late, time.thread_time() - cpu_before))


async def post_one(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = await http.post(path, json=body)
    if response.headers["content-type"].startswith("text/event-stream"):
        return response.status_code, parse_sse(response.content)
    return response.status_code, response.json()


@pytest.mark.alone  # the event loop's stalls, in real time
async def test_long_prompts_are_encoded_off_the_event_loop_while_steps_run(
    start_server: StartServer,
) -> None:
    server = await start_server(
        max_prompt_chars=MAX_PROMPT_CHARS, max_body_bytes=MAX_BODY_BYTES, cache_blocks=CACHE_BLOCKS
    )
    encode_s = min(_timed(server.recorder.tokenize, LONG_PROMPT) for _ in range(ENCODES))
    max_stall_s = STALL_SHARE * encode_s
    lateness: list[tuple[float, float]] = []
    answers: list[tuple[str, str, int, Any]] = []
    streamed: list[list[Any]] = []
    rounds_over = trio.Event()
    # One client for all, made before the measurement: the clients share the server's
    # event loop, and making an httpx client (its TLS context) alone takes tens of ms.
    limits = httpx.Limits(max_connections=CLIENTS + STREAMS)  # each reused by every round
    http = server.client(limits=limits)

    async def decode_stream() -> None:
        # One stream after another until the rounds are over: decoding all through them,
        # however fast the machine decodes.
        body = stream_body(max_new_tokens=STREAM_TOKENS, ignore_eos=True)
        while not rounds_over.is_set():
            streamed.append((await post_one(http, "/v1/stream", body))[1])

    async def client(index: int) -> None:
        long = index % 4 != 0
        prompt = LONG_PROMPT if long else MEDIUM_PROMPT
        path = ("/v1/stream", "/v1/generate", "/v1/completions")[index % 3]
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 4}
        if path != "/v1/completions":
            body = stream_body(prompt, max_new_tokens=4)
        status, answer = await post_one(http, path, body)
        answers.append(("long" if long else "medium", path, status, answer))

    async with http, trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat, lateness)
        async with trio.open_nursery() as load:
            for _ in range(STREAMS):
                load.start_soon(decode_stream)
            await server.wait_for(lambda: server.engine is not None
                                  and server.engine.statistics().running == STREAMS,
                                  "the streams decoding")
            for _ in range(ROUNDS):
                async with trio.open_nursery() as burst:
                    for index in range(CLIENTS):
                        burst.start_soon(client, index)
            rounds_over.set()
        nursery.cancel_scope.cancel(reason="the load is over")

    assert len(answers) == ROUNDS * CLIENTS
    for kind, path, status, answer in answers:
        if kind == "long":  # refused by the token budget before any stream opened
            error = answer["error"]
            assert "prompt_too_long" in (error["type"], error.get("code")), answer
            assert status == 422 or (path == "/v1/completions" and status == 400), answer
        else:
            assert status == 200, answer
            if isinstance(answer, list):  # /v1/stream
                assert [e.event for e in answer][-1] == "done", answer
                assert json.loads(answer[-1].data)["usage"]["prompt_tokens"] > 200
    for events in streamed:
        assert events[-1].event == "done"
        assert count_tokens(events) == STREAM_TOKENS
    stats = server.hub.statistics()
    assert (stats.state, stats.step_errors) == (HubState.RUNNING, 0)
    worst, cpu = max(lateness)
    assert worst < max_stall_s, (
        f"the event loop stalled {worst * 1000:.0f} ms, its thread busy {cpu * 1000:.0f} ms "
        f"of it (the most: {max(c for _, c in lateness) * 1000:.0f} ms); one long prompt "
        f"encodes in {encode_s * 1000:.0f} ms here"
    )


def _timed(fn: Any, *args: Any) -> float:
    began = time.perf_counter()
    fn(*args)
    return time.perf_counter() - began

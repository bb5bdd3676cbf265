"""A fault tied to one sequence ends its stream only, over real HTTP; the server serves on.

The fault is injected into one request's detokenizer inside the real engine on the tiny
model (``RecordingEngine.break_text``); its stream ends with an ``error`` event, a stream
running beside it finishes with ``done``, and a request made afterwards is answered.
"""

from __future__ import annotations

import json

from engine import FinishReason
from streams import HubState
from tests.http_clients import count_tokens, long_body, stream_body
from tests.http_server import RunningServer

OTHER_TOKENS = 40


async def test_a_text_fault_ends_its_stream_only_and_the_server_keeps_serving(
    server: RunningServer,
) -> None:
    victim, other = server.raw_client(), server.raw_client()
    await victim.post("/v1/stream", long_body())
    await other.post("/v1/stream", stream_body(max_new_tokens=OTHER_TOKENS, ignore_eos=True))
    await victim.read_tokens(2)
    await other.read_tokens(1)

    # The fault lands while both run: the engine is a few steps ahead of these reads, not
    # the OTHER_TOKENS that would end the other stream.
    server.recorder.hold()
    victim_id, other_id = victim.request_id(), other.request_id()
    server.recorder.break_text(victim_id)
    assert server.recorder.finish_of(other_id) is None
    server.recorder.release()

    await victim.read_to_end()
    error = json.loads(victim.events[-1].data)["error"]
    assert victim.events[-1].event == "error"
    assert error["type"] == "engine_error"
    assert "injected text fault" in error["message"]
    finish = await server.wait_finished(victim_id)
    assert finish.reason is FinishReason.ERROR
    assert finish.completion_tokens == count_tokens(victim.events)

    await other.read_to_end()
    assert other.events[-1].event == "done"
    assert count_tokens(other.events) == OTHER_TOKENS

    async with server.client() as client:
        response = await client.post("/v1/generate", json=stream_body(max_new_tokens=4))
    assert response.status_code == 200, response.text
    assert response.json()["finish_reason"] in ("length", "eos")
    stats = server.hub.statistics()
    assert (stats.state, stats.step_errors) == (HubState.RUNNING, 0)

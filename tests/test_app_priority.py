"""The native route's ``priority`` (issue 48, item 1, the native part): a band a request
asks for, refused out of range before the stream (422 naming the field), served no
higher than its key's ceiling (``app/priority_bands.py``; the other APIs:
``test_priority_routes.py``). Real HTTP against a real server."""

from __future__ import annotations

from typing import Any

import pytest

from app.priority_bands import DEFAULT_BAND, HIGHEST_BAND, LOWEST_BAND
from tests.http_clients import stream_body
from tests.http_server import RunningServer
from tests.test_app_metrics import stats


@pytest.mark.parametrize("priority", [HIGHEST_BAND - 1, LOWEST_BAND + 1, "1", 1.5, True])
async def test_a_priority_out_of_range_is_refused_naming_the_field(
    server: RunningServer, priority: Any
) -> None:
    async with server.client() as client:
        response = await client.post("/v1/stream", json=stream_body(priority=priority))
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "invalid_request" and "priority" in error["message"]
    assert server.recorder.statistics().admitted == 0


async def test_a_request_in_a_lower_band_is_served_and_counted_in_it(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        response = await client.post("/v1/stream", json=stream_body(priority=3,
                                                                     max_new_tokens=2))
    assert response.status_code == 200
    await server.wait_for(lambda: server.recorder.statistics().releases == 1, "a release")
    assert [band for band, _ in (await stats(server))["wait_ms_by_band"]] == [3]


async def test_a_request_above_the_ceiling_is_served_at_it_not_refused(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        response = await client.post("/v1/stream", json=stream_body(priority=-1,
                                                                     max_new_tokens=2))
    assert response.status_code == 200
    await server.wait_for(lambda: server.recorder.statistics().releases == 1, "a release")
    assert [band for band, _ in (await stats(server))["wait_ms_by_band"]] == [DEFAULT_BAND]

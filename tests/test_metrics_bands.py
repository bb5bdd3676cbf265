"""``/metrics`` and ``/stats`` carry the engine's per-band figures (issue 48, item 4):
real HTTP against a real server, the scrape parsed by prometheus_client."""

from __future__ import annotations

from tests.http_clients import stream_body
from tests.http_server import RunningServer
from tests.test_app_metrics import scrape, stats, value


async def test_a_served_request_shows_in_its_bands_series(server: RunningServer) -> None:
    async with server.client() as client:
        response = await client.post("/v1/stream", json=stream_body(max_new_tokens=3))
    assert response.status_code == 200
    await server.wait_for(lambda: server.recorder.statistics().releases == 1, "a release")
    current = await stats(server)
    assert [band for band, _ in current["wait_ms_by_band"]] == [0]  # the default band
    assert current["waiting_by_band"] == [] and current["priority_preemptions"] == 0
    samples = await scrape(server)
    wait = value(samples, "streamscope_queue_wait_mean_seconds", band="0")
    assert wait == current["wait_ms_by_band"][0][1] / 1000
    assert value(samples, "streamscope_priority_preemptions_total") == 0
    # Aging's floor, measured: the longest queue wait in steps; nothing lifted alone.
    assert [band for band, _ in current["longest_wait_steps_by_band"]] == [0]
    longest = value(samples, "streamscope_queue_wait_longest_steps", band="0")
    assert longest == current["longest_wait_steps_by_band"][0][1]
    assert current["aged_admissions_by_band"] == []

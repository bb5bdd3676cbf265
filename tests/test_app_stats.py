"""``GET /stats`` is the engine's, hub's and resume registry's statistics, every field.

The keys come from the dataclasses (a few renamed where a bare name would be unclear), so a
counter added to a statistics class shows up without a hand-kept list to forget.
"""

from __future__ import annotations

import dataclasses

from engine import EngineStatistics
from streams import HubStatistics
from streams.resume import ResumeStatistics
from tests.http_server import RunningServer

RENAMED = {"state": "hub_state", "waiting": "streams_waiting", "steps": "hub_steps",
           "streams": "resumable_streams", "detached": "resumable_detached"}


# Request ids of the last step's prefills: the scope shows them per key, /stats not at all.
PER_KEY_ONLY = {"last_step_prefill_ids"}


async def test_stats_has_every_statistics_field_once_and_the_same_before_and_after(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        stats = (await client.get("/stats")).json()

    for kind in (EngineStatistics, HubStatistics, ResumeStatistics):
        for field in dataclasses.fields(kind):
            name = RENAMED.get(field.name, field.name)
            if name in PER_KEY_ONLY:
                assert name not in stats  # any key may read /stats: no other key's ids
                continue
            assert any(key in stats for key in (name, f"resume_{name}")), (kind, name)
    assert stats["hub_state"] == "running"  # an enum, as its value
    assert (stats["steps"], stats["hub_steps"]) == (0, 0)  # engine's and hub's, apart
    assert stats["blocks_free"] == stats["blocks_total"]
    assert {"phase", "model", "device", "policy"} <= set(stats)

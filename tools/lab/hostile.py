"""``hostile``: one key's hostile constraints beside another key's stream (issue 43).

A nested-count regex of 17 characters, ``((a{60}){60}){60}``, and its kin cost 50-150 ms
of mask work per row per step on the embedded model's 49,152-token vocabulary, and tens
of MB each in the compiled-constraint cache: with 8 such streams open, another key's
inter-token gap went from p90 10 ms to 699 ms, and six of them took the server from 554
to 1,651 MB. This experiment measures what they cost now.

Procedure. The lab starts its server with two API keys: ``hostile`` and ``probe``.

1. Solo: the probe key reads a stream (greedy, ``ignore_eos``, ``--tokens`` tokens,
   ``/v1/stream``), timing each token event as it arrives; then asks a
   ``json_object``-constrained ``/v1/generate`` of 2 tokens, cached after its first.
2. Hostile: ``--hostile`` (8) clients of the hostile key each send, one after another
   (``--pause`` s after each answer) until the probe is done, a hostile constrained
   stream, each with a pattern not sent before (so no compile is a cache hit): the
   nested counts as a native ``regex`` (three and four levels), as a string ``pattern``
   in a native schema, in an OpenAI ``response_format`` schema, in a tool's parameters,
   in an Anthropic tool, in a Responses ``text.format`` (the chat routes only on a model
   with a chat template: not with ``--quick``). Meanwhile the probe key does as in 1.
   1 and 2 alternate ``--probes`` times (the machine's other load falls on both).
3. The server's resident memory (``/proc/<pid>/status`` VmRSS, its processes together)
   after a warm-up and at the end.

Summary: ``gap_p50_ms_solo``/``gap_p90_ms_solo`` and ``..._hostile`` (the probe's gaps
between token events; several events in one read are 0 apart), ``gap_p90_ratio``
(hostile over solo, the target at most 1.5), ``cached_json_ms_solo``/``_hostile`` (the
cached constrained request's latency, median), ``rss_growth_mb`` (target under 100),
``hostile_requests``, ``hostile_per_s`` (their rate), ``hostile_statuses`` (status:
count), ``five_xx`` (target 0), ``probe_five_xx``, ``hostile_refusal`` (one refusal's
message). With ``--control`` the hostile clients send the same bodies with an unknown
field, refused before any compile: the difference is what the constraints cost.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

from tools import server_fds
from tools.lab._raw import host_port
from tools.lab.common import Lab, Report, experiment

HOSTILE_KEY = "sk-lab-hostile-0123456789abcdefghijklmno"
PROBE_KEY = "sk-lab-probe-0123456789abcdefghijklmnopqr"
KEYS = [{"name": "hostile", "key": HOSTILE_KEY}, {"name": "probe", "key": PROBE_KEY}]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SERVED = "lab"  # the model name the server answers to
QUICK_MODELS = ("tiny-gpt2", "tiny-llama")  # no chat template: the native routes only


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hostile", type=int, help="hostile clients (default 8)")
    parser.add_argument("--probes", type=int, help="probe streams (default 4, quick 2)")
    parser.add_argument("--tokens", type=int, help="tokens a probe stream (default 64)")
    parser.add_argument("--control", action="store_true",
                        help="the same requests with an unknown field: refused before "
                             "any compile (what their rate costs without constraints)")
    parser.add_argument("--pause", type=float,
                        help="seconds a hostile client waits after each answer (default 0.25)")


def nested(index: int) -> str:
    """The ``index``-th distinct nested-count pattern: three levels of about 60, or
    four of about 20 (every 4th), in a letter of its own."""
    letter, turn = LETTERS[index % 26], index // 26
    if index % 4 == 3:
        n = 20 - turn % 5
        return f"((({letter}{{{n}}}){{{n}}}){{{n}}}){{{n}}}"
    n = 60 - turn % 20
    return f"(({letter}{{{n}}}){{{n}}}){{{n}}}"


def hostile_request(index: int, chat: bool) -> tuple[str, dict[str, Any]]:
    """The ``index``-th hostile request: its path and body (a stream)."""
    pattern = nested(index)
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}},
              "required": ["a"], "additionalProperties": False}
    question = [{"role": "user", "content": "Hi"}]
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("/v1/stream", {"prompt": "Hi", "max_new_tokens": 32,
                        "constraint": {"type": "regex", "pattern": pattern}}),
        ("/v1/stream", {"prompt": "Hi", "max_new_tokens": 32,
                        "constraint": {"type": "json_schema", "schema": schema}}),
    ]
    if chat:
        kinds += [
            ("/v1/chat/completions", {"messages": question, "stream": True, "max_tokens": 32,
                                      "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "x", "schema": schema}}}),
            ("/v1/chat/completions", {"messages": question, "stream": True, "max_tokens": 32,
                                      "tool_choice": "required", "tools": [{
                                          "type": "function",
                                          "function": {"name": "f", "parameters": schema}}]}),
            ("/v1/messages", {"messages": question, "stream": True, "max_tokens": 32,
                              "tool_choice": {"type": "any"},
                              "tools": [{"name": "f", "input_schema": schema}]}),
            ("/v1/responses", {"input": "Hi", "stream": True, "max_output_tokens": 32,
                               "text": {"format": {"type": "json_schema", "name": "s",
                                                   "schema": schema}}}),
        ]
    return kinds[index % len(kinds)]


@experiment("hostile", "one key's nested-count constraints beside another key's stream: "
            "its inter-token gaps, the server's memory, no 5xx",
            arguments=arguments, own_servers=True)
async def hostile(lab: Lab) -> Report:
    clients = lab.option("hostile", 8, 8)
    probes = lab.option("probes", 4, 2)
    tokens = lab.option("tokens", 64, 32)
    pause_s = lab.option("pause", 0.25, 0.25)
    control = bool(getattr(lab.args, "control", False))
    model = str(lab.server_settings.get("model") or "smollm2")
    chat = model not in QUICK_MODELS
    async with lab.server(api_keys=json.dumps(KEYS), max_body_bytes=65_536,
                          model_name=SERVED) as url:
        pids = server_fds.server_pids(host_port(url)[1])
        probe = _Probe(lab, url, tokens)
        await probe.warm()
        rss_before = _rss(pids)
        solo: dict[str, Any] = {"gaps": [], "cached": [], "five_xx": 0}
        beside: dict[str, Any] = {"gaps": [], "cached": [], "five_xx": 0}
        attack_s = 0.0
        # Every client is built before anything is timed: building one (its TLS
        # context) takes tens of ms of this process's loop, 8 at once some 400 ms.
        async with _Attack(url, chat, pause_s, clients, control) as attack, probe:
            for _ in range(probes):  # alternated: the machine's other load falls on both
                _add(solo, await probe.run(1))
                attack.done = False
                started = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for client in range(clients):
                        nursery.start_soon(attack.client, client)
                    _add(beside, await probe.run(1))
                    attack.done = True
                attack_s += time.perf_counter() - started
        rss_after = _rss(pids)
    summary = {
        "gap_p50_ms_solo": _pct(solo["gaps"], 50), "gap_p90_ms_solo": _pct(solo["gaps"], 90),
        "gap_p50_ms_hostile": _pct(beside["gaps"], 50),
        "gap_p90_ms_hostile": _pct(beside["gaps"], 90),
        "gap_p90_ratio": round(_pct(beside["gaps"], 90) / max(_pct(solo["gaps"], 90), 1.0), 2),
        "cached_json_ms_solo": _pct(solo["cached"], 50),
        "cached_json_ms_hostile": _pct(beside["cached"], 50),
        "rss_before_mb": round(rss_before / 2**20), "rss_after_mb": round(rss_after / 2**20),
        "rss_growth_mb": round((rss_after - rss_before) / 2**20, 1),
        "hostile_requests": sum(attack.statuses.values()),
        "hostile_per_s": round(sum(attack.statuses.values()) / max(attack_s, 1e-9), 1),
        "hostile_statuses": {str(k): v for k, v in sorted(attack.statuses.items())},
        "five_xx": sum(v for k, v in attack.statuses.items() if k >= 500),
        "probe_five_xx": solo["five_xx"] + beside["five_xx"],
        "hostile_refusal": attack.refusal,
        "model": model,
        "control": control,
    }
    return Report(summary, raw={"solo": solo, "hostile": beside,
                                "by_path": attack.by_path, "server_pids": pids})


class _Probe:
    """The probe key's streams and cached constrained requests, timed."""

    def __init__(self, lab: Lab, url: str, tokens: int) -> None:
        self.lab, self.url, self.tokens = lab, url, tokens
        self.http = httpx.AsyncClient(base_url=url, timeout=600, trust_env=False,
                                      headers={"Authorization": f"Bearer {PROBE_KEY}"})

    async def __aenter__(self) -> _Probe:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def warm(self) -> None:
        """One of each first (the library's tokenizer view is built on the first
        constraint: seconds; the first step's costs)."""
        await self.run(1)

    async def run(self, count: int) -> dict[str, Any]:
        gaps: list[float] = []
        cached: list[float] = []
        five_xx = 0
        client = self.http
        for index in range(count):
            body = {"prompt": self.lab.prompts()[index % 8], "max_new_tokens": self.tokens,
                    "ignore_eos": True}
            async with client.stream("POST", "/v1/stream", json=body) as response:
                five_xx += response.status_code >= 500
                last = None
                async for line in response.aiter_lines():
                    if line == "event: token":
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append((now - last) * 1000)
                        last = now
            # After the stream: the hostile clients' first burst is long over (8 chat
            # requests at once hold the interpreter's lock for their renders, whatever
            # they carry; that is not what this measures).
            started = time.perf_counter()
            generated = await client.post("/v1/generate", json={
                "prompt": "{", "max_new_tokens": 2, "constraint": {"type": "json_object"}})
            cached.append((time.perf_counter() - started) * 1000)
            five_xx += generated.status_code >= 500
        return {"gaps": gaps, "cached": cached, "five_xx": five_xx}


class _Attack:
    """The hostile key's clients: each sends hostile streams until ``done``."""

    def __init__(self, url: str, chat: bool, pause_s: float, clients: int,
                 control: bool = False) -> None:
        self.chat, self.pause_s, self.control = chat, pause_s, control
        self.done = False
        self.statuses: Counter[int] = Counter()
        self.by_path: dict[str, dict[str, int]] = {}
        self.refusal: str | None = None
        self.sent = 0  # each request's pattern is the next: none is sent twice
        headers = {"Authorization": f"Bearer {HOSTILE_KEY}"}
        self.http = [httpx.AsyncClient(base_url=url, timeout=600, trust_env=False,
                                       headers=headers) for _ in range(clients)]

    async def __aenter__(self) -> _Attack:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for http in self.http:
            await http.aclose()

    async def client(self, client: int) -> None:
        http = self.http[client]
        while not self.done:
            path, body = hostile_request(self.sent, self.chat)
            self.sent += 1
            if path != "/v1/stream":
                body = {**body, "model": SERVED}
            if self.control:
                body = {**body, "control_unknown_field": 1}
            async with http.stream("POST", path, json=body) as response:
                text = (await response.aread()).decode(errors="replace")
            status = response.status_code
            self.statuses[status] += 1
            counts = self.by_path.setdefault(path, {})
            counts[str(status)] = counts.get(str(status), 0) + 1
            if 400 <= status < 500 and self.refusal is None:
                self.refusal = text[:300]
            await trio.sleep(self.pause_s)


def _add(into: dict[str, Any], run: dict[str, Any]) -> None:
    for key, value in run.items():
        into[key] += value


def _rss(pids: list[int]) -> int:
    """The resident memory of ``pids`` together, in bytes."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1) if values else 0.0

"""``logprobs``: the chapter's exercise 6 with real events: log-probabilities instead of
padding. What an event with ``top_logprobs`` 20 weighs, and what four slow readers among
eight then cost under each policy, with the memory each policy holds per slow reader.

Part 1, bytes per token. One stream of ``--max-new-tokens`` tokens (greedy,
``ignore_eos``, the first prompt) in each form: ``/v1/stream`` without log-probabilities
and with ``top_logprobs`` 20; ``/v1/completions`` with ``logprobs`` 5 (its most);
``/v1/chat/completions`` with ``top_logprobs`` 20 (skipped, ``None``, when the model has no
chat template). The figure is the body's bytes over the tokens. On the first policy's
server of part 2, before its conditions: the bytes do not depend on the policy, and a
server of its own would cost a start (seconds, most of a ``--quick`` run).

Part 2, slow readers. As ``slowclient`` (eight streams on raw sockets, a server of its own
per policy, queue limit 8, stall timeout 0.25 s; ``slowclient.one_condition``), with no
padding: every request asks for ``top_logprobs`` 20, so its events are what a real client
of log-probabilities gets. k = 0 and 4 slow readers. A slow reader reads ``read_bytes``
then sleeps 0.25 s; by default ``read_bytes`` is set from the first condition with none
(the healthy streams' bytes per second over ``SLOWER``), so that it is ``SLOWER`` times
slower than the engine makes its stream on whatever model and machine, and a stream of
``--max-new-tokens`` is several times the socket buffers (about 150 KB, ``buffers``):
backpressure is real.

Memory per slow reader. The lab server's ``GET /v1/lab/queues`` is polled every
``POLL_S`` during each condition; a slow stream's peak of queued items, times what one item
weighs held two ways:

* as the stream holds it, formatted only as it is written (the design): the objects of
  one ``TokenEvent`` with its ``TokenLogprobs`` (``item_bytes``: every object made for
  that event; the token texts are not counted, as the engine shares one string per
  token of the vocabulary among all events, nor ints the interpreter caches);
* eagerly formatted: the bytes object of its native ``token`` event.

Both from the events the run actually received. Not counted: the chunk the body holds
while a write blocks and the kernel's socket buffers (both bytes either way).

Summary: ``bytes_per_token`` per form, ``item_bytes`` (objects, eager), and per policy
``healthy_slowdown`` (completion with 4 slow over 0), ``slow_received``,
``peak_queued`` (median over the slow streams), ``held_per_slow_reader_bytes``
(objects, eager: peak times the item's weight), ``read_bytes``, ``repetitions``.
Plot: bytes per token per form; memory held per slow reader per policy, both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import trio

from app.wire import token_event
from engine import TokenEvent, TokenLogprobs
from streams import SSEParser
from tools.lab.common import Lab, LabError, Report, experiment, median
from tools.lab.naive import LAB_POLICIES
from tools.lab.slowclient import STREAMS, one_condition

TOP = 20
COMPLETION_TOP = 5  # /v1/completions' most
SLOW_READERS = (0, 4)
SLOWER = 3  # a slow reader takes its stream this many times slower than it is made
PAUSE_S = 0.25
POLL_S = 0.05
ASKING = {"logprobs": True, "top_logprobs": TOP}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", nargs="+", choices=LAB_POLICIES, help="default: all five")
    parser.add_argument("--max-new-tokens", type=int, help="default 256 (quick 16)")
    parser.add_argument("--read-bytes", type=int, help="a slow reader's recv size; default: "
                        f"the engine's rate per stream over {SLOWER}, per {PAUSE_S} s")
    parser.add_argument("--repetitions", type=int, help="default 1")


@experiment(
    "logprobs",
    "events with top_logprobs 20: bytes per token, and 4 slow readers among 8 per policy",
    server={"queue_limit": 8, "stall_timeout_s": 0.25},
    arguments=arguments,
    own_servers=True,
)
async def logprobs(lab: Lab) -> Report:
    policies = list(lab.args.policies or LAB_POLICIES)
    tokens = lab.option("max_new_tokens", 256, 16)
    repetitions = lab.option("repetitions", 1, 1)
    prompts = lab.prompts(STREAMS)
    forms: dict[str, float | None] = {}
    samples: list[dict[str, Any]] = []

    read_bytes: int | None = getattr(lab.args, "read_bytes", None)
    runs: list[dict[str, Any]] = []
    for policy in policies:
        async with lab.server(policy=policy) as url:
            if not forms:  # part 1, on the first server
                forms, samples = await _bytes_per_token(lab, url, prompts[0], tokens)
            for rep in range(repetitions):
                for k in SLOW_READERS:
                    await lab.wait_idle(url)
                    run = await _watched(lab, url, prompts, policy, k, tokens,
                                         read_bytes or 1 << 20)
                    if read_bytes is None and k == 0:  # the pace of the first healthy run
                        rate = run["bytes_per_token"] * tokens / run["healthy_completion_s"]
                        read_bytes = max(256, int(rate * PAUSE_S / SLOWER))
                    runs.append({"rep": rep, "read_bytes": read_bytes, **run})
                    if lab.progress:
                        print(f"  {policy:<10} k={k}: healthy {run['healthy_completion_s']} s, "
                              f"peak queued {run['peak_queued']}", flush=True)

    objects, eager = _item_weights(samples)

    def per_policy(policy: str, k: int, key: str) -> float | None:
        return median([r[key] for r in runs if r["policy"] == policy and r["k"] == k])

    peaks = {p: per_policy(p, 4, "peak_queued") for p in policies}
    summary: dict[str, Any] = {
        "bytes_per_token": forms,
        "item_bytes": {"objects": objects, "eager": eager},
        "healthy_slowdown": {p: _ratio(per_policy(p, 4, "healthy_completion_s"),
                                       per_policy(p, 0, "healthy_completion_s"))
                             for p in policies},
        "healthy_completion_s": {p: {k: per_policy(p, k, "healthy_completion_s")
                                     for k in SLOW_READERS} for p in policies},
        "slow_received": {p: _count(s["terminal"] for r in runs if r["policy"] == p
                                    for s in r["slow"]) for p in policies},
        "peak_queued": peaks,
        "held_per_slow_reader_bytes": {
            p: None if v is None else {"objects": round(v * (objects or 0)),
                                       "eager": round(v * (eager or 0))}
            for p, v in peaks.items()},
        "errors": sum(r["healthy_errors"] for r in runs),
        "max_new_tokens": tokens,
        "read_bytes": read_bytes,
        "pause_s": PAUSE_S,
        "repetitions": repetitions,
    }
    return Report(summary, {"runs": runs, "sample_events": samples[:4]},
                  plot=lambda fig: _draw(fig, summary, policies))


async def _bytes_per_token(lab: Lab, url: str, prompt: str, tokens: int
                           ) -> tuple[dict[str, float | None], list[dict[str, Any]]]:
    """Body bytes per token of each form on the server at ``url``, and the token events of
    the native stream with ``top_logprobs`` 20 (their data)."""
    common = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "native_none": ("/v1/stream", {"prompt": prompt, "max_new_tokens": tokens,
                                       "ignore_eos": True}),
        f"native_top{TOP}": ("/v1/stream", {"prompt": prompt, "max_new_tokens": tokens,
                                            "ignore_eos": True, **ASKING}),
        f"completions_logprobs{COMPLETION_TOP}": (
            "/v1/completions", {"prompt": prompt, "logprobs": COMPLETION_TOP, **common}),
        f"chat_top{TOP}": ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], **ASKING, **common}),
    }
    forms: dict[str, float | None] = {}
    samples: list[dict[str, Any]] = []
    async with lab.client(url) as client:
        for name, (path, body) in bodies.items():
            async with client.stream("POST", path, json=body) as response:
                raw = b"".join([chunk async for chunk in response.aiter_raw()])
            if response.status_code != 200:
                if name.startswith("chat"):  # no chat template: the form is not served
                    forms[name] = None
                    continue
                raise LabError(f"{path} answered {response.status_code}: {raw[:300]!r}")
            forms[name] = round(len(raw) / tokens, 1)
            if name == f"native_top{TOP}":
                samples = [json.loads(e.data) for e in SSEParser().feed(raw)
                           if e.event == "token"]
    await lab.wait_idle(url)
    return forms, samples


def _item_weights(samples: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Median bytes of one received token event held as objects and eagerly formatted."""
    texts: dict[str, str] = {}
    objects, eager = [], []
    for n, data in enumerate(samples, start=2):
        event = _as_event(data, texts)
        objects.append(item_bytes(event, shared={id(t) for t in texts.values()}))
        eager.append(sys.getsizeof(token_event(n, event)))
    return median(objects), median(eager)


def _as_event(data: dict[str, Any], texts: dict[str, str]) -> TokenEvent:
    """The TokenEvent the data was made from; token texts shared through ``texts``, as
    the engine shares them (``engine.logprobs.TokenTexts``)."""
    lp = data["logprobs"]

    def text(value: str) -> str:
        return texts.setdefault(value, value)

    top = tuple((t["id"], text(t["token"]), t["logprob"]) for t in lp["top"])
    return TokenEvent("0" * 32, data["index"], data["id"], data["text"],
                      TokenLogprobs(text(lp["token"]), lp["logprob"], top))


def item_bytes(event: TokenEvent, shared: set[int]) -> int:
    """``sys.getsizeof`` over every object ``event`` is made of, once each, but those in
    ``shared`` and the ints the interpreter caches (-5 to 256). The request id is shared
    by all the events of a stream: not counted either."""
    seen = set(shared) | {id(event.request_id)}
    total, todo = 0, [event]
    while todo:
        obj: Any = todo.pop()
        if id(obj) in seen or obj is None or (type(obj) is int and -5 <= obj <= 256):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, tuple):
            todo.extend(obj)
        elif hasattr(obj, "__slots__"):
            todo.extend(getattr(obj, name) for name in obj.__slots__)
    return total


async def _watched(lab: Lab, url: str, prompts: list[str], policy: str, k: int, tokens: int,
                   read_bytes: int) -> dict[str, Any]:
    """One slowclient condition with every request asking for ``top_logprobs`` 20, and
    the peak queued items of each slow stream (``GET /v1/lab/queues``, polled)."""
    peaks: dict[str, int] = {}
    done = trio.Event()

    async def poll() -> None:
        async with lab.client(url) as client:
            while not done.is_set():
                queued = (await client.get("/v1/lab/queues")).json()["queued"]
                for request_id, n in queued.items():
                    peaks[request_id] = max(peaks.get(request_id, 0), n)
                with trio.move_on_after(POLL_S):
                    await done.wait()

    run: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        try:
            run = await one_condition(lab, url, prompts, policy, k, tokens, PAUSE_S,
                                      read_bytes, extra=ASKING)
        finally:
            done.set()
    slow_peaks = [peaks.get(s["request_id"] or "", 0) for s in run["slow"]]
    return {**run, "slow_peak_queued": slow_peaks, "peak_queued": median(slow_peaks),
            "streams": None}  # the per-token times: slowclient's JSON has them


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def _draw(fig: Any, summary: dict[str, Any], policies: list[str]) -> None:
    sizes, held = fig.subplots(1, 2)
    forms = {k: v for k, v in summary["bytes_per_token"].items() if v is not None}
    sizes.bar(range(len(forms)), list(forms.values()))
    sizes.set_xticks(range(len(forms)), list(forms), rotation=20, fontsize=8)
    sizes.set_ylabel("bytes per token on the wire")
    sizes.set_title("what an event weighs")
    width = 0.4
    for offset, way in ((-width / 2, "objects"), (width / 2, "eager")):
        values = [(summary["held_per_slow_reader_bytes"][p] or {}).get(way) or 0
                  for p in policies]
        held.bar([i + offset for i in range(len(policies))], values, width,
                 label="items, formatted as written" if way == "objects"
                 else "eagerly formatted events")
    held.set_xticks(range(len(policies)), policies)
    held.set_ylabel("bytes queued per slow reader (peak)")
    held.set_title("4 slow readers among 8")
    held.legend()
    for axis in (sizes, held):
        axis.grid(alpha=0.3, axis="y")

"""The share of valid answers when the embedded model is asked for JSON of a schema.

::

    python -m tools.jsonvalid --json out.json            # starts the server (SmolLM2, CPU)
    python -m tools.jsonvalid --url http://127.0.0.1:8000 --max-tokens 0   # no max_tokens

Each question is asked with the openai SDK's ``chat.completions.parse`` (a strict
``response_format`` of a pydantic model), as a client of OpenAI's API would; an answer is
valid when ``parse`` returns the model's object, and not valid when it raises (the
answer was cut at the token budget: ``LengthFinishReasonError``, or it did not
validate). Issue 45: with a city's population as a schema ``integer``, SmolLM2 wrote
digits until ``max_tokens``; ``engine/json_bounds.py`` bounds them (run this before and
after it to compare). The schemas: the 8 cities (name, country, population), then a
few with other numbers (a price, coordinates, a person's age and height).

Greedy (``temperature`` 0) unless ``--temperature``; the figures are the model's on this
checkout, so they change with the model and the constraint library, not with the load.
Started servers (no ``--url``) run ``hypercorn -k trio app:app`` on a free loopback port
(``tools/server.py``) and are stopped afterwards. Nothing is sent anywhere else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pydantic
import trio

from tools.server import open_server

CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Mumbai", "Cairo", "Toronto"]


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str
    country: str
    population: int


class Product(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str
    price: float
    in_stock: bool


class Place(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str
    latitude: float
    longitude: float


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str
    age: int
    height_m: float


def questions() -> list[tuple[str, type[pydantic.BaseModel], str]]:
    """(schema name, pydantic model, question) for every request the tool makes."""
    asked: list[tuple[str, type[pydantic.BaseModel], str]] = [
        ("city", City, f"What is the population of {city}? Answer in JSON.")
        for city in CITIES]
    asked += [
        ("product", Product, "Describe a laptop for sale with its price, in JSON."),
        ("product", Product, "A cup of coffee: its name and price in euros, in JSON."),
        ("place", Place, "Give the coordinates of the Eiffel Tower in JSON."),
        ("place", Place, "Where is Mount Everest? Latitude and longitude, in JSON."),
        ("person", Person, "Describe Albert Einstein as JSON: name, age at death, height."),
        ("person", Person, "Invent a basketball player: name, age and height, as JSON."),
    ]
    return asked


async def ask(sdk: openai.AsyncOpenAI, model: type[pydantic.BaseModel], question: str,
              args: argparse.Namespace) -> dict[str, Any]:
    """One question's outcome: valid or why not, with the answer's text and tokens."""
    options: dict[str, Any] = {"temperature": args.temperature}
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    began = time.perf_counter()
    try:
        completion = await sdk.chat.completions.parse(
            model="smollm2", response_format=model,
            messages=[{"role": "user", "content": question}], **options)
    except openai.LengthFinishReasonError as exc:
        usage = exc.completion.usage
        return {"valid": False, "why": "length", "seconds": time.perf_counter() - began,
                "tokens": None if usage is None else usage.completion_tokens,
                "text": exc.completion.choices[0].message.content}
    except (pydantic.ValidationError, openai.APIStatusError) as exc:
        return {"valid": False, "why": type(exc).__name__, "detail": str(exc)[:300],
                "seconds": time.perf_counter() - began}
    choice = completion.choices[0]
    usage = completion.usage
    return {"valid": choice.message.parsed is not None, "why": choice.finish_reason,
            "seconds": time.perf_counter() - began,
            "tokens": None if usage is None else usage.completion_tokens,
            "text": choice.message.content}


async def measure_at(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every question at once (the server batches them: on a CPU, one step of 14
    sequences costs little more than one of one), each answer in its question's row."""
    asked = questions()
    results: list[dict[str, Any]] = [{} for _ in asked]

    async def one(n: int, sdk: openai.AsyncOpenAI) -> None:
        schema, model, question = asked[n]
        outcome = await ask(sdk, model, question, args)
        results[n] = {"schema": schema, "question": question, **outcome}
        if args.progress:
            print(f"{schema:8} valid={outcome['valid']!s:5} {outcome.get('text')!r:.100}",
                  file=sys.stderr)

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=args.timeout) as sdk, trio.open_nursery() as nursery:
        for n in range(len(asked)):
            nursery.start_soon(one, n, sdk)
    by_schema: dict[str, dict[str, Any]] = {}
    for row in results:
        counts = by_schema.setdefault(row["schema"], {"asked": 0, "valid": 0})
        counts["asked"] += 1
        counts["valid"] += int(row["valid"])
    for counts in by_schema.values():
        counts["share"] = counts["valid"] / counts["asked"]
    valid = sum(int(row["valid"]) for row in results)
    return {"asked": len(results), "valid": valid, "share": valid / len(results),
            "cut_at_length": sum(row["why"] == "length" for row in results),
            "by_schema": by_schema, "results": results}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    settings = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    if args.url:
        return {"server": args.url, **settings, **await measure_at(args.url, args)}
    server_settings = {"model": "smollm2", "device": "cpu", "max_body_bytes": 64 * 1024}
    async with open_server(server_settings) as url:
        report = await measure_at(url, args)
    return {"server": "started: smollm2 on cpu", **settings, **report}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.jsonvalid", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server's base URL (default: start one)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="each request's max_tokens (default 64: an answer of these "
                             "schemas takes about 30; 0: send none)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for one answer (default 300)")
    parser.add_argument("--json", type=Path, help="write the report here (default: stdout)")
    parser.add_argument("--progress", action="store_true", help="a line per answer on stderr")
    args = parser.parse_args(argv)
    if args.max_tokens == 0:
        args.max_tokens = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = trio.run(measure, args)
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if args.json:
        args.json.write_text(text + "\n")
        summary = {k: report[k] for k in ("asked", "valid", "share", "cut_at_length")}
        print(json.dumps(summary))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``docs/api.md``'s "Every request field" tables, held to the official SDKs and the server.

The tables say, for every field of the installed ``openai`` and ``anthropic`` SDKs'
request types (and the extensions the server takes), whether the server serves it,
ignores it (accepted, changing nothing) or refuses it (a 400 naming it). Here:

* every field of the SDKs' request types has a row, so a new SDK's new field fails
  until someone says what the server does with it;
* every ignored and every refused row has its probe below, and no probe lacks a row, so
  a row's verdict cannot change without its check;
* over real HTTP on loopback, one server with the tiny model's ChatML template
  (``chat_server``, as ``test_openai_sdk``'s): an ignored field gets a 200 with the same greedy
  answer as the request without it; a refused field gets a 400 naming it, and its
  neutral values (null, and the ones the row names) a 200.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic.types.message_count_tokens_params as count_params
import anthropic.types.message_create_params as message_params
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import openai.types.responses.response_create_params as response_params
import pytest

from app.settings import Settings
from engine.engine import Engine
from engine.model import LoadedModel
from tests.http_server import RecordingEngine, RunningServer, StartServer
from tests.test_openai_sdk import with_chat_template

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
SECTION = "## Every request field"
VERDICTS = frozenset({"served", "ignored", "refused"})
MODEL = "tiny"  # chat_server's alias

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"

# Each route's request type in the SDK (the non-streaming one: it has ``stream`` too).
SDK_PARAMS: dict[str, Any] = {
    CHAT: chat_params.CompletionCreateParamsNonStreaming,
    COMPLETIONS: completion_params.CompletionCreateParamsNonStreaming,
    RESPONSES: response_params.ResponseCreateParamsNonStreaming,
    MESSAGES: message_params.MessageCreateParamsNonStreaming,
    COUNT_TOKENS: count_params.MessageCountTokensParams,
}

USER_TURN = [{"role": "user", "content": "The capital of France is"}]
# The smallest request of each route: greedy and short, so that an answer is one step
# or two and the same every time.
BASE_BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": USER_TURN, "max_tokens": 2, "temperature": 0},
    COMPLETIONS: {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2,
                  "temperature": 0},
    RESPONSES: {"model": MODEL, "input": "The capital of France is",
                "max_output_tokens": 2, "temperature": 0, "store": False},
    MESSAGES: {"model": MODEL, "messages": USER_TURN, "max_tokens": 2, "temperature": 0},
    COUNT_TOKENS: {"model": MODEL, "messages": USER_TURN},
}


def sdk_fields(route: str) -> set[str]:
    """The field names of ``route``'s request type in the installed SDK."""
    params = SDK_PARAMS[route]
    return set(params.__required_keys__) | set(params.__optional_keys__)


# -- the tables -------------------------------------------------------------------------

_HEADING = re.compile(r"^### `POST (/v1/[a-z_/]+)`$")
_ROW = re.compile(r"^\| `([a-z_]+)`[^|]* \| ([a-z]+) \| (.+) \|$")


def field_tables(text: str) -> dict[str, dict[str, str]]:
    """Each route's rows in the section: field name -> verdict.

    Raises: AssertionError for a row given twice, or a section with no tables."""
    body = text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, dict[str, str]] = {}
    route = None
    for line in body.splitlines():
        if heading := _HEADING.match(line):
            route = heading.group(1)
            tables[route] = {}
        elif route is not None and (row := _ROW.match(line)):
            name, verdict = row.group(1), row.group(2)
            assert name not in tables[route], f"{route}: {name} has two rows"
            tables[route][name] = verdict
    assert tables, f"no tables under {SECTION!r} in {DOC}"
    return tables


@pytest.fixture(scope="module")
def tables() -> dict[str, dict[str, str]]:
    return field_tables(DOC.read_text())


def test_every_sdk_field_has_a_row(tables: dict[str, dict[str, str]]) -> None:
    assert set(tables) == set(SDK_PARAMS)
    missing = {route: sorted(sdk_fields(route) - set(rows)) for route, rows in tables.items()}
    assert missing == {route: [] for route in tables}


def test_every_row_has_a_known_verdict(tables: dict[str, dict[str, str]]) -> None:
    unknown = [(route, name, verdict) for route, rows in tables.items()
               for name, verdict in rows.items() if verdict not in VERDICTS]
    assert unknown == []


def test_the_parser_reads_a_row_and_refuses_a_second_one() -> None:
    text = (f"{SECTION}\n\n### `POST /v1/x`\n\n| field | verdict | what |\n|---|---|---|\n"
            "| `a_b` (vLLM) | served | it does |\n\n## Next\n| `c` | refused | no |\n")

    assert field_tables(text) == {"/v1/x": {"a_b": "served"}}
    with pytest.raises(AssertionError, match="two rows"):
        field_tables(text.replace("\n\n## Next", "\n| `a_b` | ignored | twice |\n\n## Next"))


# -- the probes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """How to send a field: ``value`` in the body, or as ``header`` where the SDK sends
    it as one; for a refused field, ``neutral`` are the values accepted besides null."""

    value: Any
    neutral: tuple[Any, ...] = ()
    header: str | None = None

    def request(self, route: str, name: str, value: Any) -> dict[str, Any]:
        """httpx's arguments for ``route``'s smallest request with ``name`` at ``value``."""
        if self.header is not None:
            return {"json": BASE_BODIES[route], "headers": {self.header: value}}
        return {"json": {**BASE_BODIES[route], name: value}}


MODERATION = {"model": "omni-moderation-latest"}
CACHE_OPTIONS = {"mode": "explicit", "ttl": "30m"}

IGNORED: dict[str, dict[str, Probe]] = {
    CHAT: {
        "reasoning_effort": Probe("low"),
        "metadata": Probe({"team": "docs"}),
        "user": Probe("someone"),
        "safety_identifier": Probe("someone"),
        "prompt_cache_key": Probe("docs"),
        "prompt_cache_options": Probe(CACHE_OPTIONS),
        "prompt_cache_retention": Probe("24h"),
        "verbosity": Probe("low"),
    },
    COMPLETIONS: {"user": Probe("someone")},
    RESPONSES: {
        "user": Probe("someone"),
        "safety_identifier": Probe("someone"),
        "prompt_cache_key": Probe("docs"),
        "prompt_cache_options": Probe(CACHE_OPTIONS),
        "prompt_cache_retention": Probe("24h"),
        "stream_options": Probe({"include_obfuscation": False}),
        "reasoning": Probe({"effort": "low", "summary": "auto"}),
    },
    MESSAGES: {
        "metadata": Probe({"user_id": "someone"}),
        "cache_control": Probe({"type": "ephemeral"}),
        "user_profile_id": Probe("someone", header="anthropic-user-profile-id"),
        "workspace_id": Probe("wrkspc_docs", header="anthropic-workspace-id"),
    },
    COUNT_TOKENS: {
        "cache_control": Probe({"type": "ephemeral"}),
        "user_profile_id": Probe("someone", header="anthropic-user-profile-id"),
        "workspace_id": Probe("wrkspc_docs", header="anthropic-workspace-id"),
    },
}

_ANTHROPIC_REFUSED = {
    "thinking": Probe({"type": "enabled", "budget_tokens": 1024}, ({"type": "disabled"},)),
    "speed": Probe("fast", ("standard",)),
    "mcp_servers": Probe([{"type": "url", "url": "https://example.com", "name": "x"}],
                         ([],)),
    "context_management": Probe({"edits": [{"type": "clear_tool_uses_20250919"}]}),
}
REFUSED: dict[str, dict[str, Probe]] = {
    CHAT: {
        "store": Probe(True, (False,)),
        "audio": Probe({"voice": "alloy", "format": "wav"}),
        "modalities": Probe(["text", "audio"], (["text"],)),
        "prediction": Probe({"type": "content", "content": "Paris"}),
        "web_search_options": Probe({}),
        "functions": Probe([{"name": "get_weather", "parameters": {}}], ([],)),
        "function_call": Probe("auto", ("none",)),
        "min_tokens": Probe(3, (0,)),
        "best_of": Probe(2, (1,)),
        "moderation": Probe(MODERATION),
    },
    COMPLETIONS: {
        "echo": Probe(True, (False,)),
        "suffix": Probe(" and so on", ("",)),
        "best_of": Probe(2, (1,)),
        "min_tokens": Probe(3, (0,)),
    },
    RESPONSES: {
        "truncation": Probe("auto", ("disabled",)),
        "conversation": Probe("conv_docs"),
        "prompt": Probe({"id": "pmpt_docs"}),
        "max_tool_calls": Probe(3),
        "context_management": Probe([{"type": "compaction"}]),
        "moderation": Probe(MODERATION),
    },
    MESSAGES: {
        **_ANTHROPIC_REFUSED,
        "container": Probe("container_docs"),
        "inference_geo": Probe("us"),
        "diagnostics": Probe({"previous_message_id": "msg_docs"}),
    },
    COUNT_TOKENS: dict(_ANTHROPIC_REFUSED),
}


@pytest.mark.parametrize(("verdict", "probes"), [("ignored", IGNORED), ("refused", REFUSED)])
def test_every_ignored_and_refused_row_has_its_probe(
    tables: dict[str, dict[str, str]], verdict: str, probes: dict[str, dict[str, Probe]]
) -> None:
    rows = {route: sorted(n for n, v in fields.items() if v == verdict)
            for route, fields in tables.items()}
    assert rows == {route: sorted(probes.get(route, {})) for route in tables}


# -- the server -------------------------------------------------------------------------


@pytest.fixture
async def chat_server(start_server: StartServer,
                      tiny_model: Callable[[str], LoadedModel]) -> RunningServer:
    """One server for every probe: the tiny model with the ChatML template of the
    OpenAI tests (``test_openai_sdk.with_chat_template``), served as ``tiny``."""
    loaded = with_chat_template(tiny_model("tiny-gpt2"))

    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch,
                                      num_blocks=s.cache_blocks, block_size=s.block_size))

    return await start_server(make_engine=make_engine, model_name=MODEL)


def answer_of(route: str, document: dict[str, Any]) -> object:
    """What a greedy answer says, whatever its id and timing."""
    if route == CHAT:
        return document["choices"][0]["message"]["content"]
    if route == COMPLETIONS:
        return document["choices"][0]["text"]
    if route == RESPONSES:  # the output items' texts (each item has an id of its own)
        return [[part.get("text") for part in item.get("content", [])]
                for item in document["output"]]
    if route == MESSAGES:
        return document["content"]
    return document["input_tokens"]


def names_the_field(route: str, document: dict[str, Any], name: str) -> bool:
    """Whether a 400's error names ``name``: OpenAI's ``param`` (or a place inside it),
    Anthropic's message after the error type (``invalid_request: speed: ...``)."""
    error = document.get("error") or {}
    if route.startswith("/v1/messages"):
        message = error.get("message", "")
        return message.split(": ", 2)[1:2] == [name]
    param = error.get("param") or ""
    return re.split(r"[.\[]", param, maxsplit=1)[0] == name


async def test_ignored_fields_change_nothing_and_refused_ones_are_400s_naming_them(
    chat_server: RunningServer,
) -> None:
    wrong: list[str] = []
    async with chat_server.client() as client:
        async def send(route: str, **request: Any) -> tuple[int, dict[str, Any]]:
            response = await client.post(route, **request)
            return response.status_code, response.json()

        for route, probes in IGNORED.items():
            status, document = await send(route, json=BASE_BODIES[route])
            assert status == 200, (route, document)
            baseline = answer_of(route, document)
            for name, probe in probes.items():
                status, document = await send(route, **probe.request(route, name, probe.value))
                if status != 200 or answer_of(route, document) != baseline:
                    wrong.append(f"{route} {name}: ignored, got {status} {document}")

        for route, probes in REFUSED.items():
            for name, probe in probes.items():
                status, document = await send(route, **probe.request(route, name, probe.value))
                if status != 400 or not names_the_field(route, document, name):
                    wrong.append(f"{route} {name}: refused, got {status} {document}")
                for neutral in (None, *probe.neutral):
                    status, document = await send(route,
                                                  **probe.request(route, name, neutral))
                    if status != 200:
                        wrong.append(f"{route} {name}={neutral!r}: neutral, got {status} "
                                     f"{document}")

    assert wrong == [], "\n".join(wrong)



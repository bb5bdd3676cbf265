"""The package boundaries of ``docs/architecture.md``, enforced as one table each.

What a package may LOAD is checked in a fresh interpreter per row (``sys.modules`` after the
import: an import that hides in a function run at import time shows up there). What a package
may IMPORT is read from the source by an AST walk over every import statement, function
bodies included, so that an import deferred into a function cannot hide a cycle or a crossing.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ("app", "engine", "streams")
TORCH = ("torch", "transformers")
WEB = ("quart", "quart_trio", "hypercorn", "werkzeug")
TOOLS_ONLY = ("matplotlib", "tqdm", "numpy")  # the `tools` extra (pyproject.toml)
MAX_SERVICE_LINES = 400
MAX_TEST_LINES = 600
OUTSIDE = re.compile(r"shared/(DESIGN|reference)")  # the team's notes beside the checkout

# -- what importing each package loads, in a fresh interpreter ---------------------------

NEVER_LOADS: list[tuple[str, tuple[str, ...]]] = [
    ("import engine", ("trio", "redis", "streams", "app", *WEB, *TORCH)),
    ("import engine.scheduler", ("trio", "redis", "streams", "app", *WEB, *TORCH)),
    ("import engine.block_allocator", ("trio", "redis", "streams", "app", *WEB, *TORCH)),
    ("import streams", ("redis", "app", *WEB, *TORCH)),
    ("import streams.resume", ("redis", "app", *WEB, *TORCH)),
    ("import streams.sse", ("trio", "redis", "app", *WEB, *TORCH)),
    ("import streams.policy", ("trio", "redis", "app", *WEB, *TORCH)),
    ("import app", ("trio", "redis", *WEB, *TORCH)),
    ("import app.settings", ("redis", *WEB, *TORCH)),
    ("import app.wire", ("trio", "redis", *WEB, *TORCH)),
    ("import app.schemas", ("trio", "redis", *WEB, *TORCH)),
    ("import app.runtime", ("redis", *WEB, *TORCH)),
    ("import app.routes", ("redis", *TORCH)),
    ("import app.factory", ("redis", "tests", "tools", *TORCH)),  # the whole service
]


def loaded_after(statement: str) -> dict[str, object]:
    code = (
        f"{statement}\nimport json, sys\n"
        "print(json.dumps({'modules': sorted(sys.modules), 'extra': globals().get('RESULT')}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
        timeout=120,
    )
    loaded: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


def top_level(modules: object, names: tuple[str, ...]) -> set[str]:
    assert isinstance(modules, list)
    return {m for m in modules if m.split(".")[0] in names}


@pytest.mark.parametrize(("statement", "forbidden"), NEVER_LOADS, ids=[r[0] for r in NEVER_LOADS])
def test_an_import_loads_nothing_across_its_boundary(
    statement: str, forbidden: tuple[str, ...]
) -> None:
    assert top_level(loaded_after(statement)["modules"], forbidden) == set()


def test_importing_the_app_reads_no_environment_builds_nothing_and_patches_nothing() -> None:
    # A variable the settings refuse: reading the environment would raise.
    statement = (
        "import os; os.environ['STREAMSCOPE_NO_SUCH_SETTING'] = '1'\n"
        "import app, app.settings, app.runtime, app.edge.hypercorn_patches, app.edge.h2_protocol\n"
        "import app.edge.closing_server, app.edge.request_drain, app.edge.body_hot_path\n"
        "import hypercorn.trio.run, hypercorn.trio.tcp_server, hypercorn.protocol\n"
        "import hypercorn.protocol.h2 as h2p\n"
        "RESULT = [hypercorn.trio.run.TCPServer is hypercorn.trio.tcp_server.TCPServer,\n"
        "          hypercorn.protocol.H2Protocol is h2p.H2Protocol,\n"
        "          h2p.StreamBuffer.__module__ == 'hypercorn.protocol.h2',\n"
        "          app.app._app is None]"
    )
    loaded = loaded_after(statement)

    assert loaded["extra"] == [True, True, True, True]  # hypercorn as it was; no app built
    assert top_level(loaded["modules"], ("app",)) & {"app.factory", "app.routes"} == set()


# -- what the source imports, function bodies included -------------------------------------


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def imports_of(path: Path) -> frozenset[str]:
    """Every module a file imports anywhere in it, each ``from m import n`` also as
    ``m.n``; relative imports made absolute."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]  # an __init__'s package is its folder too
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            if node.module:  # ``from . import m`` imports the submodule, not its package
                found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return frozenset(found)


def service_files() -> list[Path]:
    return sorted(path for package in SERVICE for path in (ROOT / package).rglob("*.py"))


def test_no_module_imports_one_that_imports_it_back() -> None:
    files = {module_of(path): path for package in (*SERVICE, "tools")
             for path in (ROOT / package).rglob("*.py")}
    graph = {name: {m for m in imports_of(path) if m in files and m != name}
             for name, path in files.items()}

    # The standard library's topological sort finds a cycle if there is one, in linear
    # time (listing every simple cycle instead took over a minute of the suite).
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"an import cycle: {' -> '.join(error.args[1])}")


def crossings(rule: str) -> dict[str, list[str]]:
    """Each service module's imports that break ``rule``."""
    found: dict[str, list[str]] = {}
    for path in service_files():
        module = module_of(path)
        bad = sorted(m for m in imports_of(path) if breaks(rule, module, m))
        if bad:
            found[module] = bad
    return found


def breaks(rule: str, importer: str, imported: str) -> bool:
    top = imported.split(".")[0]
    if rule == "hypercorn":
        return top == "hypercorn" and not within(importer, "app.edge")
    if rule == "roots":  # another package's internals: only its root (and streams.resume's)
        for root in FACES:
            if within(imported, root) and not within(importer, root):
                return imported not in roots_and_their_names(root)
        return False
    if rule == "tools":
        return top in (*TOOLS_ONLY, "tests", "tools")
    if rule == "edge":  # the edge serves a built app; building it is the root's
        return within(importer, "app.edge") and imported in ("app.factory", "app.cli")
    raise AssertionError(rule)


# The packages whose internals others reach only through their root (their face), the
# more specific first: ``streams.resume`` is a face inside ``streams``.
FACES = ("engine", "streams.resume", "streams", "app.runtime", "app.schemas", "app.wire")


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@cache
def roots_and_their_names(root: str) -> frozenset[str]:
    exported = getattr(importlib.import_module(root), "__all__", [])
    return frozenset({root, *(f"{root}.{name}" for name in exported),
                      *(["streams.resume"] if root == "streams" else [])})


@pytest.mark.parametrize("rule", ["hypercorn", "roots", "tools", "edge"])
def test_no_service_module_crosses_a_boundary(rule: str) -> None:
    """hypercorn: only ``app.edge`` imports it. roots: other packages import ``engine``,
    ``streams``, ``streams.resume``, ``app.runtime``, ``app.schemas`` and ``app.wire`` at
    their roots only. tools: the service never imports
    the tools' extra, the tests or the tools. edge: ``app.edge`` never imports the
    composition root (``app.factory``) or the command beside it (``app.cli``)."""
    assert crossings(rule) == {}


# -- public faces and sizes -----------------------------------------------------------------

EXPORTS: dict[str, list[str]] = {  # each package's public face, as a literal
    "app": [
        "app",
    ],
    "app.edge": [],
    "app.routes": [
        "make_anthropic_blueprint", "make_blueprint", "make_openai_blueprint",
        "make_page_blueprint", "make_responses_blueprint", "make_resumable_blueprint",
        "make_scope_blueprint",
    ],
    "app.runtime": [
        "HANDOVER_LEAD_S", "LOADING_RETRY_AFTER_S", "SHUTDOWN_RETRY_AFTER_S",
        "STORE_CHECK_TIMEOUT_S", "MakeEngine", "MakeHub", "OutputParsing", "Phase", "Prepared",
        "Rebuilder", "ResponseStore", "ResponseStoreUnavailable", "ResponsesFull", "Runtime",
        "ServingEngine", "StoreBounds", "StoredResponse",
        "load_engine_from_settings", "response_store", "stop_deadline_s",
    ],
    "app.schemas": [
        "MAX_DEADLINE_MS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "OPENAI_DEFAULT_MAX_TOKENS",
        "ChatBody", "ChatMessage", "CompletionsBody", "CountTokensBody", "GenerateBody",
        "MessagesBody", "OpenAIBody", "RequestLimits", "ResponsesBody", "parse_generate_body",
    ],
    "app.wire": [
        "CHAT", "COMPLETION", "DONE", "FINISH_REASONS", "KEEPALIVE_COMMENT", "RETRY_LINE",
        "RETRY_MS", "TAKEN_OVER_EVENT", "AnthropicEvents", "ChatShape", "ChoiceFinish",
        "ChoiceShape", "CompletionShape",
        "Encoder", "ErrorEnvelope", "NativeEvents", "OpenAIChunks", "OutputParser",
        "PlainText", "ReplayedEvents", "ResponseEvents", "ResumableEvents",
        "ScopeEvents", "SharedFrames", "ToolCalls", "choices_usage", "encode_json_event",
        "error_data", "event_without_id", "item_event", "logprobs_data", "replay",
        "start_event", "token_event",
        "tool_message", "usage", "usage_data", "whole_answer", "whole_message",
    ],
    "engine": [
        "MAX_LOGIT_BIAS", "MAX_LOGIT_BIAS_ENTRIES", "MAX_PENALTY", "MAX_SEED",
        "MAX_TEMPERATURE", "MAX_TOP_LOGPROBS", "MAX_TOP_P", "MIN_SEED",
        "MIN_TEMPERATURE", "MIN_TOP_K",
        "MIN_TOP_P", "ChatTemplateError", "Constraint", "ConstraintKind", "DoubleRelease",
        "DuplicateRequestId", "EmptyPrompt",
        "EngineError", "EngineEvent", "EngineStatistics", "FinishEvent", "FinishReason",
        "GenerationRequest", "InvalidConstraint", "InvalidMaxNewTokens", "InvalidRequest",
        "InvalidSampling", "PrecisionError", "PromptTooLong", "SamplingParams",
        "StepReentered", "TokenEvent", "TokenLogprobs",
        "bounded_schema", "load_engine",
        "validate_request", "validate_sampling",
    ],
    "streams": [
        "DeadlineUnmeetable", "ErrorType", "Hub", "HubError", "HubSettings", "HubState",
        "HubStatistics", "Keepalives", "NotAccepting", "PolicyName", "RunStep", "SSEParser",
        "ScopeFeed", "ScopeFrame", "ScopeItem", "ScopeMoment", "ScopePool", "ScopeRow",
        "ScopeStep", "ScopeWatcher", "ServerSentEvent", "StepEngine", "StreamEnd",
        "StreamError", "StreamItem", "StreamState", "StreamStatistics", "TokenStream",
        "WaitingLimitReached", "encode_comment", "encode_event",
    ],
    "streams.resume": [
        "Adopt", "BadPosition", "Draining", "EventLog", "Holding", "LoggedEvent",
        "MemoryEventLog", "NothingToResume", "Reader", "ReaderBusy", "Rebuild", "RedisEventLog",
        "RedisStore", "RemoteReader", "ResumeError", "ResumeRegistry", "ResumeStatistics",
        "SharedEventLog",
        "StoreRejected", "StoreStatistics", "StoreUnavailable", "TakenOver", "WriterGone",
        "generated_ids", "spec_of", "spec_parts", "with_seed",
    ],
}


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_each_package_exports_exactly_its_public_names(package: str) -> None:
    module = importlib.import_module(package)

    assert module.__all__ == EXPORTS[package]
    assert [name for name in EXPORTS[package] if not hasattr(module, name)] == []


def test_no_service_module_is_over_400_lines_and_no_test_file_over_600() -> None:
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path, limit in [*((p, MAX_SERVICE_LINES) for p in service_files()),
                            *((p, MAX_TEST_LINES) for p in (ROOT / "tests").rglob("*.py"))]
        if (lines := len(path.read_text().splitlines())) > limit
    }

    assert too_long == {}


def test_nothing_in_the_repository_points_outside_it() -> None:
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *service_files(),
             *(ROOT / "tests").rglob("*.py")]
    pointing_out = [str(path.relative_to(ROOT)) for path in texts
                    if OUTSIDE.search(path.read_text())]

    assert pointing_out == []

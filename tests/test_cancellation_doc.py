"""``docs/cancellation.md`` names only what exists, so it cannot rot silently.

The doc writes every name in backticks, in one of three forms (outside fenced blocks):

    `package.module`                   a module: it must import
    `package.module:Name.attribute`    an attribute path in a module: each step must exist
    `tests/test_file.py::test_name`    a test: the file must define that test function

Any other backticked text that looks like a dotted name (``trio.Cancelled``) must be a
module, so a name cannot dodge the check by being written another way: write
``trio:Cancelled``. Quoted or called forms (``"http.disconnect"``, ``close()``) are prose.
A test named on a line that starts with ``**Example`` or ``**Solution`` must run on the
mock clock (take pytest-trio's ``autojump_clock`` fixture): those are the doc's worked
examples and the exercises' solutions.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cancellation.md"

SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = rf"{IDENT}(?:\.{IDENT})*"
MODULE = re.compile(rf"^{DOTTED}$")
ATTRIBUTE = re.compile(rf"^({DOTTED}):({DOTTED})$")
TEST = re.compile(rf"^(tests/{IDENT}\.py)::({IDENT})$")
MOCK_CLOCK_LINE = re.compile(r"^\*\*(Example|Solution)")
MIN_NAMES = 60  # the doc names far more; fewer means the syntax changed under the check


def names(text: str) -> list[tuple[str, bool]]:
    """Every backticked span outside fenced blocks, with whether its line asks for a
    mock-clock test."""
    found: list[tuple[str, bool]] = []
    for line in FENCE.sub("", text).splitlines():
        mock_clock = bool(MOCK_CLOCK_LINE.match(line))
        found.extend((span, mock_clock) for span in SPAN.findall(line))
    return found


@cache
def functions_of(path: str) -> dict[str, list[str]]:
    """The top-level test functions of a test file: name -> its parameters' names."""
    tree = ast.parse((ROOT / path).read_text())
    return {
        node.name: [arg.arg for arg in node.args.args]
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def problem(span: str, mock_clock: bool) -> str | None:
    """What is wrong with one backticked span, or None (fine, or prose)."""
    if match := TEST.match(span):
        path, name = match.groups()
        if not (ROOT / path).is_file():
            return f"{span}: no file {path}"
        params = functions_of(path).get(name)
        if params is None:
            return f"{span}: {path} defines no function {name}"
        if mock_clock and "autojump_clock" not in params:
            return f"{span}: an example or solution, but not on the mock clock"
        return None
    if match := ATTRIBUTE.match(span):
        module_name, path = match.groups()
        try:
            obj: object = importlib.import_module(module_name)
        except ImportError as exc:
            return f"{span}: module {module_name} does not import ({exc})"
        for part in path.split("."):
            if not hasattr(obj, part):
                return f"{span}: {module_name} has no {path}"
            obj = getattr(obj, part)
        return None
    if MODULE.match(span) and "." in span:
        try:
            importlib.import_module(span)
        except ImportError as exc:
            if exc.name is not None and span.startswith(exc.name):
                return f"{span}: not a module; write a name as module:attribute"
            return f"{span}: module {span} does not import ({exc})"
    return None


def problems(text: str) -> list[str]:
    return [p for span, clock in names(text) if (p := problem(span, clock)) is not None]


def test_every_name_in_the_doc_exists() -> None:
    text = DOC.read_text()
    assert problems(text) == []
    checked = [s for s, _ in names(text) if TEST.match(s) or ATTRIBUTE.match(s) or "." in s]
    assert len(checked) >= MIN_NAMES


def test_every_worked_example_is_a_mock_clock_test_and_there_are_some() -> None:
    examples = [s for s, clock in names(DOC.read_text()) if clock and TEST.match(s)]
    assert len(examples) >= 15
    assert all(problem(s, True) is None for s in examples)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("`app.conection`", "not a module"),
        ("`app.conection:StreamingConnection`", "does not import"),
        ("`app.edge.connection:StreamingConnection.handle_mesages`", "has no"),
        ("`streams.stream:TokenStream.close.nothing`", "has no"),
        ("`trio.Cancelled`", "not a module"),
        ("`tests/test_stream.py::test_no_such_test`", "defines no function"),
        ("`tests/test_no_such_file.py::test_x`", "no file"),
        ("**Example.** `tests/test_app_disconnect.py::"
         "test_generate_is_cancelled_when_its_client_leaves`", "not on the mock clock"),
    ],
)
def test_a_misspelled_name_is_caught(line: str, expected: str) -> None:
    found = problems(f"Some prose, then {line}.\n" if not line.startswith("**") else line)
    assert len(found) == 1 and expected in found[0]


def test_prose_and_fenced_blocks_are_not_names() -> None:
    text = '`"http.disconnect"` `close()` `STREAMSCOPE_RESUME_GRACE_S`\n```\n`app.nope:X`\n```\n'
    assert problems(text) == []
    names = "`trio:Cancelled` `app.edge.connection` `streams.open_streams:OpenStreams.cancel`"
    assert problems(names) == []

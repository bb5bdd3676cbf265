"""What a doc names in backticks, and whether each named thing exists.

The docs that promise their names are real (``docs/architecture.md``,
``docs/cancellation.md``) write every name in backticks, in one of these forms (outside
fenced blocks):

    `package.module`                   a module: it must import
    `package.module:Name.attribute`    an attribute path in a module: each step must exist
    `tests/test_file.py::test_name`    a test: the file must define that test function
    `app/routes/pipeline.py`           a file or folder of the tree: it must exist
    `package.module:name(...)`         a call: its name is checked as above
    `ClassName`                        a class alone: the tree (``app``, ``engine``,
                                       ``streams``, ``tools``) defines it, or it is a
                                       builtin or one of ``trio``'s names

Any other backticked text that looks like a dotted name, called or not
(``trio.Cancelled``, ``runtime.prepare(...)``), must be a module, so a name cannot dodge
the check by being written another way: write ``trio:Cancelled``. A span with a space,
a quoted one (``"http.disconnect"``), a word without a dot (``close()``, ``slow_client``)
and a path from ``/`` (a URL: ``/v1/requests``) are prose.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ("app", "engine", "streams", "tools")  # where a class named alone must be

SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = rf"{IDENT}(?:\.{IDENT})*"
MODULE = re.compile(rf"^{DOTTED}$")
ATTRIBUTE = re.compile(rf"^({DOTTED}):({DOTTED})$")
TEST = re.compile(rf"^(tests/{IDENT}\.py)::({IDENT})$")
CALL = re.compile(rf"^((?:{DOTTED}:)?{DOTTED})\(.*\)$")
PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)+/?$")
CLASS = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")  # CamelCase, not a CONSTANT


def spans(text: str) -> list[tuple[str, str]]:
    """Every backticked span outside fenced blocks, with the line it is on."""
    return [(span, line) for line in FENCE.sub("", text).splitlines()
            for span in SPAN.findall(line)]


@cache
def functions_of(path: str) -> dict[str, list[str]]:
    """The top-level functions of a test file: name -> its parameters' names."""
    tree = ast.parse((ROOT / path).read_text())
    return {
        node.name: [arg.arg for arg in node.args.args]
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


@cache
def classes_in_tree() -> frozenset[str]:
    """Every class and function the tree's source defines, at any depth."""
    found: set[str] = set()
    for package in SOURCE:
        for path in (ROOT / package).rglob("*.py"):
            found.update(node.name for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.ClassDef | ast.FunctionDef
                                       | ast.AsyncFunctionDef))
    return frozenset(found)


def missing_attribute(span: str, module_name: str, path: str) -> str | None:
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        return f"{span}: module {module_name} does not import ({exc})"
    for part in path.split("."):
        if not hasattr(obj, part):
            return f"{span}: {module_name} has no {path}"
        obj = getattr(obj, part)
    return None


def missing_module(span: str, name: str) -> str | None:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if exc.name is not None and name.startswith(exc.name):
            return f"{span}: not a module; write a name as module:attribute"
        return f"{span}: module {name} does not import ({exc})"
    return None


def missing_test(span: str, path: str, name: str, *, mock_clock: bool) -> str | None:
    if not (ROOT / path).is_file():
        return f"{span}: no file {path}"
    params = functions_of(path).get(name)
    if params is None:
        return f"{span}: {path} defines no function {name}"
    if mock_clock and "autojump_clock" not in params:
        return f"{span}: an example or solution, but not on the mock clock"
    return None


def problem(span: str, *, mock_clock: bool = False) -> str | None:
    """What is wrong with one backticked span, or None (it exists, or it is prose).
    ``mock_clock``: a test it names must take pytest-trio's ``autojump_clock``."""
    if match := TEST.match(span):
        path, name = match.groups()
        return missing_test(span, path, name, mock_clock=mock_clock)
    if match := CALL.match(span):
        span = match.group(1)  # the name called; its arguments are prose
    if match := ATTRIBUTE.match(span):
        return missing_attribute(span, *match.groups())
    if MODULE.match(span) and "." in span:
        return missing_module(span, span)
    if CLASS.match(span):
        if span in classes_in_tree() or hasattr(builtins, span):
            return None
        if hasattr(importlib.import_module("trio"), span):
            return None
        return f"{span}: no such class in the tree; write it as module:{span}"
    if PATH.match(span) and not (ROOT / span).exists():
        return f"{span}: no such file or folder"
    return None


def problems(text: str) -> list[str]:
    """Every named thing in ``text`` that does not exist."""
    return [p for span, _ in spans(text) if (p := problem(span)) is not None]


def is_name(span: str) -> bool:
    """Whether ``problem`` looks ``span`` up (else it is prose)."""
    if TEST.match(span):
        return True
    if match := CALL.match(span):
        span = match.group(1)
    return bool(ATTRIBUTE.match(span) or (MODULE.match(span) and "." in span)
                or CLASS.match(span) or PATH.match(span))


def checked(text: str) -> list[str]:
    """The spans of ``text`` that name something the check looks up."""
    return [span for span, _ in spans(text) if is_name(span)]

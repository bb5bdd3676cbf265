"""The package boundaries of DESIGN.md, checked by what an import actually loads.

Each check imports in a fresh interpreter and lists ``sys.modules``: an import that
crosses a boundary shows up there even when it hides in a function body run at import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers")
WEB = ("quart", "quart_trio", "hypercorn", "werkzeug")
ENGINE_ROOT = {"engine", "engine.errors", "engine.types"}  # what ``import engine`` loads


def modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
        timeout=60,
    )
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def top_level(modules: set[str], names: tuple[str, ...]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in names}


@pytest.fixture(scope="module")
def after_streams_and_engine() -> set[str]:
    return modules_after("import streams, engine")


@pytest.fixture(scope="module")
def after_app() -> set[str]:
    return modules_after("import app")


def test_streams_and_engine_load_no_torch_transformers_or_web_framework(
    after_streams_and_engine: set[str],
) -> None:
    assert top_level(after_streams_and_engine, HEAVY + WEB) == set()


def test_engine_loads_no_trio() -> None:
    modules = modules_after("import engine")

    assert top_level(modules, ("trio", "streams", "app", *WEB, *HEAVY)) == set()


def test_streams_never_imports_app(after_streams_and_engine: set[str]) -> None:
    assert top_level(after_streams_and_engine, ("app",)) == set()


def test_app_imports_only_the_engine_package_root(after_app: set[str]) -> None:
    assert {m for m in after_app if m.split(".")[0] == "engine"} == ENGINE_ROOT
    assert top_level(after_app, HEAVY) == set()


def test_nothing_imports_tests_or_tools(after_app: set[str]) -> None:
    assert top_level(after_app, ("tests", "tools")) == set()


# -- the tools' dependencies, and import cycles, read from the source ---------------------

TOOLS_ONLY = ("matplotlib", "tqdm", "numpy")  # the `tools` extra (pyproject.toml)
SERVICE = ("app", "engine", "streams")


def source_imports(path: Path) -> set[str]:
    """Every module a file imports at module level (``if TYPE_CHECKING`` blocks included),
    each ``from m import n`` also as ``m.n``; relative imports made absolute."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]  # an __init__'s package is its folder too
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                name = ".".join([*base, *([node.module] if node.module else [])])
                found.add(name)
                found.update(f"{name}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return found


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_service_never_imports_the_tools_dependencies() -> None:
    offenders = {
        module_of(path): sorted(top_level(source_imports(path), TOOLS_ONLY))
        for package in SERVICE
        for path in sorted((ROOT / package).rglob("*.py"))
        if top_level(source_imports(path), TOOLS_ONLY)
    }

    assert offenders == {}


@pytest.mark.parametrize("package", [*SERVICE, "tools"])
def test_no_module_imports_one_that_imports_it_back(package: str) -> None:
    files = {module_of(path): path for path in (ROOT / package).rglob("*.py")}
    graph = {name: {m for m in source_imports(path) if m in files and m != name}
             for name, path in files.items()}
    cycles: list[list[str]] = []

    def walk(path: list[str]) -> None:
        for following in sorted(graph[path[-1]]):
            if following == path[0]:
                cycles.append([*path, following])
            elif following not in path and following > path[0]:  # each cycle once
                walk([*path, following])

    for name in sorted(graph):
        walk([name])

    assert cycles == []

"""The package boundaries of DESIGN.md, checked by what an import actually loads.

Each check imports in a fresh interpreter and lists ``sys.modules``: an import that
crosses a boundary shows up there even when it hides in a function body run at import.
"""

from __future__ import annotations

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

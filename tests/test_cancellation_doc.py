"""``docs/cancellation.md`` names only what exists, so it cannot rot silently.

The doc writes every name in backticks, in the forms ``tests/doc_names.py`` checks (a
module, ``module:attribute``, a test ``tests/file.py::test_name``, a file of the tree, a
class alone). A test named on a line that starts with ``**Example`` or ``**Solution``
must run on the mock clock (take pytest-trio's ``autojump_clock`` fixture): those are
the doc's worked examples and the exercises' solutions.

The doc names the five outcomes of a cancel once, numbered; each variant says which it
is in a paragraph that starts with ``**Outcome.**``, and each row of the rules table in
its outcome column, both as the outcome's name and its number: ``closed by its owner
(2)``. In the code, every docstring's ``Cancellation:`` paragraph in ``CODE_NAMING_OUTCOMES``
names one by its name (the whole tree: ``app``, ``engine``, ``streams``, ``tools``).
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.doc_names import ROOT, TEST, checked, problem, spans

DOC = ROOT / "docs" / "cancellation.md"

MOCK_CLOCK_LINE = re.compile(r"^\*\*(Example|Solution)")
OUTCOME_ITEM = re.compile(r"^(\d)\. \*\*(.+?)\.\*\*", re.MULTILINE)
OUTCOME_REF = re.compile(r"\((\d)\)")
# A docstring's cancellation paragraph: from "Cancellation" to a blank line or the end.
CANCELLATION = re.compile(r"Cancellation[^:\n]*:(.*?)(?:\n\s*\n|\Z)", re.DOTALL)
# The source whose every cancellation paragraph names its outcome, as globs: the whole
# tree of the service and its tools.
CODE_NAMING_OUTCOMES = ("app/**/*.py", "engine/**/*.py", "streams/**/*.py", "tools/**/*.py")
MIN_NAMES = 60  # the doc names far more; fewer means the syntax changed under the check


def names(text: str) -> list[tuple[str, bool]]:
    """Every backticked span outside fenced blocks, with whether its line asks for a
    mock-clock test."""
    return [(span, bool(MOCK_CLOCK_LINE.match(line))) for span, line in spans(text)]


def problems(text: str) -> list[str]:
    return [p for span, clock in names(text)
            if (p := problem(span, mock_clock=clock)) is not None]


def test_every_name_in_the_doc_exists() -> None:
    text = DOC.read_text()
    assert problems(text) == []
    assert len(checked(text)) >= MIN_NAMES


def section(text: str, heading: str) -> str:
    """The text under a ``## `` heading, up to the next one."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def outcomes(text: str) -> dict[int, str]:
    """The numbered outcomes of the doc's outcomes section: number -> name, lower case."""
    found = OUTCOME_ITEM.findall(section(text, "The five outcomes of a cancel"))
    return {int(number): name.lower() for number, name in found}


def outcome_problems(text: str, known: dict[int, str]) -> list[str]:
    """References in ``text`` to an outcome by number whose name is not beside it, or to
    no outcome at all."""
    flat = " ".join(text.split()).lower()
    refs = [int(n) for n in OUTCOME_REF.findall(flat)]
    if not refs:
        return [f"names no outcome: {flat[:80]}"]
    return [f"({n}) is not {known.get(n)!r}: {flat[:80]}"
            for n in refs if n not in known or f"{known[n]} ({n})" not in flat]


def outcome_paragraphs(text: str) -> dict[str, str]:
    """Each variant's heading -> its paragraph that starts with ``**Outcome.**`` ('' if
    none)."""
    found: dict[str, str] = {}
    for chunk in section(text, "Variants").split("\n### ")[1:]:
        heading, _, body = chunk.partition("\n")
        paragraph = next((p for p in (b.strip() for b in body.split("\n\n"))
                          if p.startswith("**Outcome.**")), "")
        found[heading] = paragraph
    return found


def test_the_doc_names_five_outcomes_once() -> None:
    known = outcomes(DOC.read_text())
    assert sorted(known) == [1, 2, 3, 4, 5]
    assert len(set(known.values())) == 5


def test_every_variant_says_which_outcome_it_is() -> None:
    text = DOC.read_text()
    known = outcomes(text)
    paragraphs = outcome_paragraphs(text)
    assert len(paragraphs) >= 5
    assert {h: p for h, p in paragraphs.items() if not p} == {}
    assert [p for paragraph in paragraphs.values()
            for p in outcome_problems(paragraph, known)] == []


def test_every_rule_says_which_outcome_it_is() -> None:
    text = DOC.read_text()
    known = outcomes(text)
    table = [line for line in section(text, "The rules, in one place").splitlines()
             if line.startswith("|")]
    rows = table[2:]  # past the header and its rule
    assert len(rows) >= 5
    assert [p for row in rows for p in outcome_problems(row.split(" | ")[2], known)] == []


@pytest.mark.parametrize(
    ("paragraph", "expected"),
    [
        ("**Outcome.** Closed by its owner (3): wrong number.", "is not"),
        ("**Outcome.** Closed by its owner (7).", "is not"),
        ("**Outcome.** Whatever happens happens.", "names no outcome"),
    ],
)
def test_an_outcome_named_wrongly_is_caught(paragraph: str, expected: str) -> None:
    found = outcome_problems(paragraph, outcomes(DOC.read_text()))
    assert len(found) == 1 and expected in found[0]


def cancellation_paragraphs(source: str) -> list[tuple[int, str]]:
    """Every docstring's cancellation paragraph in ``source``: (line, text)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            line = getattr(node, "lineno", 1)
            found.extend((line, m.group(1)) for m in CANCELLATION.finditer(doc or ""))
    return found


def names_an_outcome(paragraph: str, known: dict[int, str]) -> bool:
    """Whether ``paragraph`` names an outcome as its own: "a render is never abandoned"
    names none."""
    flat = " ".join(paragraph.split()).lower()
    return any(re.search(rf"(?<!never )(?<!not ){re.escape(name)}", flat)
               for name in known.values())


def paragraphs_naming_no_outcome(source: str, known: dict[int, str]) -> list[str]:
    return [f"line {line}: {' '.join(text.split())[:100]}"
            for line, text in cancellation_paragraphs(source)
            if not names_an_outcome(text, known)]


def test_every_cancellation_paragraph_of_the_code_names_its_outcome() -> None:
    known = outcomes(DOC.read_text())
    files = sorted(path for pattern in CODE_NAMING_OUTCOMES for path in ROOT.glob(pattern))
    found = {str(path.relative_to(ROOT)): bad for path in files
             if (bad := paragraphs_naming_no_outcome(path.read_text(), known))}
    assert found == {}
    assert sum(len(cancellation_paragraphs(p.read_text())) for p in files) >= 200


def test_a_cancellation_paragraph_naming_no_outcome_is_caught() -> None:
    known = outcomes(DOC.read_text())
    source = ('async def f():\n    """Do it.\n\n    Cancellation: as ``g``\'s.\n    """\n\n'
              'async def g():\n    """Cancellation: nothing to undo: a read."""\n\n'
              'async def h():\n    """Cancellation: a render is never abandoned."""\n\n'
              'async def i():\n    """Cancellation: finished first, not abandoned."""\n')
    assert [p.split(":")[0] for p in paragraphs_naming_no_outcome(source, known)] == [
        "line 1", "line 10"]


def test_every_worked_example_is_a_mock_clock_test_and_there_are_some() -> None:
    examples = [s for s, clock in names(DOC.read_text()) if clock and TEST.match(s)]
    assert len(examples) >= 15
    assert all(problem(s, mock_clock=True) is None for s in examples)


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

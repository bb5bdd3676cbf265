"""``docs/cancellation.md`` names only what exists, so it cannot rot silently.

The doc writes every name in backticks, in the forms ``tests/doc_names.py`` checks (a
module, ``module:attribute``, a test ``tests/file.py::test_name``, a file of the tree, a
class alone). A test named on a line that starts with ``**Example`` or ``**Solution``
must run on the mock clock (take pytest-trio's ``autojump_clock`` fixture): those are
the doc's worked examples and the exercises' solutions.
"""

from __future__ import annotations

import re

import pytest

from tests.doc_names import ROOT, TEST, checked, problem, spans

DOC = ROOT / "docs" / "cancellation.md"

MOCK_CLOCK_LINE = re.compile(r"^\*\*(Example|Solution)")
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

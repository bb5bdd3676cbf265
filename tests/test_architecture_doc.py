"""``docs/architecture.md``, the maintained map, names only what exists.

Every file, module, class and function the map names in backticks is looked up
(``tests/doc_names.py``: a module, ``module:Class.method``, a file or folder of the
tree, a class alone), so a rename or a move breaks this test rather than the map.
"""

from __future__ import annotations

import pytest

from tests.doc_names import ROOT, checked, problems

DOC = ROOT / "docs" / "architecture.md"
MIN_NAMES = 80  # the map names more; fewer means the syntax changed under the check


def test_every_name_on_the_map_exists() -> None:
    text = DOC.read_text()
    assert problems(text) == []
    assert len(checked(text)) >= MIN_NAMES


@pytest.mark.parametrize(
    ("span", "expected"),
    [
        ("`app/routes/no_such_view.py`", "no such file"),
        ("`app/wire/tool_stream.py`", "no such file"),
        ("`tools/no_such_lab`", "no such file"),
        ("`app.routes.pipeline:Pipeline.no_such_step`", "has no"),
        ("`app.edge.connection:own`", "has no"),
        ("`app.routes.pipeline:Pipeline.serve(adapter)`", ""),
        ("`app.routes.pipeline:Pipeline.sreve(adapter)`", "has no"),
        ("`runtime.prepare(request, policy)`", "not a module"),
        ("`Pipeline.serve`", "not a module"),
        ("`NoSuchClassAnywhere`", "no such class"),
        ("`StoredResponse`", ""),
        ("`Cancelled`", ""),
    ],
)
def test_a_missing_name_is_caught_and_an_existing_one_passes(span: str, expected: str) -> None:
    found = problems(f"The map names {span} here.\n")
    if expected:
        assert len(found) == 1 and expected in found[0]
    else:
        assert found == []


def test_prose_is_not_a_name() -> None:
    prose = ('`/v1/requests` `"http.disconnect"` `close()` `slow_client` `STREAMSCOPE_*` '
             '`hypercorn -k trio app:app` `200 text/event-stream`\n')
    assert problems(prose) == []

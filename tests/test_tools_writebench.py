"""tools.writebench runs and reports every variant (its figures are not checked: a
benchmark is a command, the suite checks that it works)."""

from __future__ import annotations

import json
from pathlib import Path

from tools import writebench


def test_writebench_writes_every_variant_and_its_savings(tmp_path: Path) -> None:
    out = tmp_path / "writebench.json"
    assert writebench.main(["--writes", "200", "--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["us_per_op"]) == {*writebench.WRITES, *writebench.WAITS}
    assert all(value > 0 for value in data["us_per_op"].values())
    assert {"write_saving_us", "wait_saving_us", "load_avg"} <= set(data)

"""Settings from STREAMSCOPE_* variables: defaults, parsing, and clear startup failures."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from app.settings import Settings, SettingsError, settings_table
from streams import PolicyName


def test_no_variables_gives_the_defaults() -> None:
    assert Settings.from_env({}) == Settings()


def test_variables_are_parsed_into_their_types() -> None:
    settings = Settings.from_env({
        "STREAMSCOPE_MODEL": "tiny-llama",
        "STREAMSCOPE_DEVICE": "CPU",
        "STREAMSCOPE_POLICY": "drop",
        "STREAMSCOPE_MAX_BATCH": "4",
        "STREAMSCOPE_KEEPALIVE_S": "0.5",
        "STREAMSCOPE_RESUME_GRACE_S": "2",
        "STREAMSCOPE_BLOCK_SIZE": "",  # empty counts as unset
        "PATH": "/bin",  # not ours: ignored
    })

    assert (settings.model, settings.device, settings.policy) == (
        "tiny-llama", "cpu", PolicyName.DROP
    )
    assert (settings.max_batch, settings.keepalive_s, settings.resume_grace_s) == (
        4, 0.5, 2.0
    )
    assert settings.block_size == 16


def test_every_bad_value_is_named_in_one_error() -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({
            "STREAMSCOPE_MAX_BATCH": "zero",
            "STREAMSCOPE_KEEPALIVE_S": "-1",
            "STREAMSCOPE_POLICY": "fifo",
            "STREAMSCOPE_DEVICE": "tpu",
            "STREAMSCOPE_MODEL": "/no/such/folder",
        })

    for name in ("MAX_BATCH", "KEEPALIVE_S", "POLICY", "DEVICE", "MODEL"):
        assert f"STREAMSCOPE_{name}=" in str(caught.value)


def test_unknown_streamscope_variable_is_refused() -> None:
    with pytest.raises(SettingsError, match="STREAMSCOPE_MAXBATCH is not a setting"):
        Settings.from_env({"STREAMSCOPE_MAXBATCH": "4"})


def test_default_max_new_tokens_over_the_limit_is_refused() -> None:
    with pytest.raises(SettingsError, match="STREAMSCOPE_DEFAULT_MAX_NEW_TOKENS"):
        Settings.from_env({
            "STREAMSCOPE_MAX_NEW_TOKENS_LIMIT": "10", "STREAMSCOPE_DEFAULT_MAX_NEW_TOKENS": "11",
        })


def test_settings_table_lists_every_variable_with_its_default() -> None:
    table = {name: default for name, default, _ in settings_table()}

    assert len(table) == len(fields(Settings))
    assert table["STREAMSCOPE_POLICY"] == "pause-drop"
    assert table["STREAMSCOPE_DEVICE"] == "(auto)"
    assert table["STREAMSCOPE_MAX_BODY_BYTES"] == "65536"


def test_readme_settings_table_is_the_code_s() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    rows = {
        cells[1].strip("` "): (cells[2].strip("` "), cells[3].strip())
        for line in readme.splitlines()
        if line.startswith("| `STREAMSCOPE_")
        for cells in [line.split("|")]
    }

    assert rows == {name: (default, doc) for name, default, doc in settings_table()}

"""Settings from STREAMSCOPE_* variables: defaults, parsing, and clear startup failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Settings, SettingsError
from app.settings_table import settings_table
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

    assert len(table) == len(Settings.model_fields)
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


def test_the_hub_s_limits_are_checked_by_the_hub_and_named_by_their_variable() -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({"STREAMSCOPE_QUEUE_LIMIT": "0", "STREAMSCOPE_MAX_WAITING": "-2",
                           "STREAMSCOPE_STALL_TIMEOUT_S": "inf"})

    assert caught.value.problems == [
        "STREAMSCOPE_MAX_WAITING='-2': max_waiting must be >= 1, not -2",
        "STREAMSCOPE_QUEUE_LIMIT='0': queue_limit must be >= 1, not 0",
        "STREAMSCOPE_STALL_TIMEOUT_S='inf': stall_timeout_s must be finite and > 0, not inf",
    ]


def test_settings_made_in_code_are_validated_and_read_no_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMSCOPE_MAX_BATCH", "3")

    assert Settings().max_batch == 32
    assert Settings.from_env().max_batch == 3
    assert Settings().replace(max_batch=5).max_batch == 5
    with pytest.raises(SettingsError, match=r"STREAMSCOPE_BLOCK_SIZE=0: expected a whole number"):
        Settings(block_size=0)
    with pytest.raises(SettingsError, match="STREAMSCOPE_KEEPALIVE_S"):
        Settings().replace(keepalive_s=float("nan"))


def test_a_bad_resume_store_is_named_without_its_value() -> None:
    with pytest.raises(SettingsError, match="STREAMSCOPE_RESUME_STORE: expected") as caught:
        Settings.from_env({"STREAMSCOPE_RESUME_STORE": "http://user:password@host"})

    assert "password" not in str(caught.value)


def test_policies_are_read_in_any_case_and_comma_separated() -> None:
    settings = Settings.from_env({"STREAMSCOPE_POLICY": "Pause",
                                  "STREAMSCOPE_REQUEST_POLICIES": " drop , PAUSE ,"})

    assert settings.policy is PolicyName.PAUSE
    assert settings.request_policies == {PolicyName.DROP, PolicyName.PAUSE}

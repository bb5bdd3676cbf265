"""The README's settings table, from the settings' own fields (``app.settings``).

Each field's description is its meaning and its default as shown is its value (or the
field's ``shown``), so the table and the code cannot drift apart
(tests/test_app_settings.py checks the README against it).
"""

from __future__ import annotations

from .settings import Settings, env_name


def settings_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting, in declaration order."""
    rows = []
    for name, f in Settings.model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        shown = extra.get("shown") or _show(f.default)
        rows.append((env_name(name), str(shown), f.description or ""))
    return rows


def _show(value: object) -> str:
    if value is None:
        return "(auto)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, frozenset):
        return ",".join(sorted(_show(v) for v in value))
    return str(getattr(value, "value", value))

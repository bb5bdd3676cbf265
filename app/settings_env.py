"""Where the settings come from and how a problem with them is told.

``app/settings.py`` says what can be set and what is valid; this module reads the
``STREAMSCOPE_*`` variables of an environment (``read_environ``), turns pydantic's
validation errors into one line per problem in the words of a person setting an
environment variable (``problems``, never a secret's value), and writes the settings as
the rows of ``docs/settings.md`` (``settings_table``, ``python -m tools.settings_doc``).
It knows the settings model only as a pydantic model class, so ``settings.py`` imports
it and not the other way round.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, TypeVar

import pydantic
from pydantic import Field
from pydantic_settings import BaseSettings, EnvSettingsSource

ENV_PREFIX = "STREAMSCOPE_"
# The shipped proxy configs' variables (deploy/haproxy.cfg: STREAMSCOPE_LB_BIND,
# STREAMSCOPE_LB_REPLICA_A, ...): an operator exports them in the shell that starts the
# replicas too, so a replica ignores them rather than refusing to start. No setting of
# the server's own may begin so (tests/test_affinity.py checks).
PROXY_PREFIX = "STREAMSCOPE_LB_"
PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Milliseconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Model = TypeVar("Model", bound=BaseSettings)
# Variables renamed: the old name is still read, with a warning, unless the new one is set.
RENAMED = {"STREAMSCOPE_OWNER_LEASE_S": "STREAMSCOPE_WRITER_LEASE_S"}


class SettingsError(ValueError):
    """One or more ``STREAMSCOPE_`` variables are invalid; the message names each one."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid settings:\n  " + "\n  ".join(problems))
        self.problems = problems


def setting(default: Any, doc: str, *, shown: str | None = None, repr: bool = True) -> Any:
    """A field with its settings-page row: its meaning, and the default as shown."""
    return Field(default, description=doc, repr=repr,
                 json_schema_extra={"shown": shown} if shown else None)


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def read_environ(model: type[Model], environ: Mapping[str, str]) -> Model:
    """``model`` made from ``environ``'s ``STREAMSCOPE_*`` variables (an old name in
    ``RENAMED`` read as its new one, with a ``FutureWarning``, which Python shows by default).

    Raises:
        SettingsError: naming every unknown variable and every bad value.
    """
    environ = dict(environ)
    for old, new in RENAMED.items():
        if old in environ:
            value = environ.pop(old)
            warnings.warn(f"{old} is now called {new}: set that instead", FutureWarning,
                          stacklevel=2)
            environ.setdefault(new, value)
    known = {env_name(name) for name in model.model_fields}
    found = [
        f"{name} is not a setting (known: {', '.join(sorted(known))})"
        for name in sorted(environ)
        if name.startswith(ENV_PREFIX) and not name.startswith(PROXY_PREFIX)
        and name not in known
    ]
    try:
        settings = model(**_EnvironSource(model, environ)())
    except SettingsError as exc:
        found += exc.problems
    if found:
        raise SettingsError(found)
    return settings


class _EnvironSource(EnvSettingsSource):
    """pydantic-settings' environment source, over a given mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {name.lower(): value.strip() for name, value in self._environ.items()
                if name.startswith(ENV_PREFIX) and value.strip()}


# What a pydantic error type means, said as the old hand-made parsers said it. The unit
# comes from the field's name (_s: seconds, _ms: milliseconds).
_PHRASES = {
    "int_parsing": "expected a whole number",
    "int_from_float": "expected a whole number",
    "int_type": "expected a whole number",
    "float_parsing": "expected a {unit}",
    "float_type": "expected a {unit}",
    "finite_number": "expected a finite {unit}",
    "greater_than_equal": "expected a whole number >= {ge}",
    "greater_than": "expected a finite {unit} > {gt:g}",
    "enum": "expected one of {expected}",
    "literal_error": "expected one of {expected}",
    "frozen_set_type": "expected a comma-separated list",
}


def problems(exc: pydantic.ValidationError, *, env_name: Callable[[str], str],
             secrets: Collection[str]) -> list[str]:
    """One line per error: ``NAME='raw': expected ...`` (the environment's text) or
    ``NAME=value: expected ...`` (in code); never the value of a field in ``secrets``;
    a check across fields as its own message."""
    found = []
    for error in exc.errors():
        if not error["loc"]:  # _consistent: the message names its variables
            found.append(error["msg"].removeprefix("Value error, "))
            continue
        field = str(error["loc"][0])
        name = env_name(field)
        unit = ("number of seconds" if field.endswith("_s")
                else "number of milliseconds" if field.endswith("_ms") else "number")
        phrase = _PHRASES.get(error["type"])
        message = (phrase.format(unit=unit, **error.get("ctx", {})) if phrase
                   else error["msg"].removeprefix("Value error, "))
        if field in secrets:
            found.append(f"{name}: {message}")
        else:
            found.append(f"{name}={error.get('input')!r}: {message}")
    return list(dict.fromkeys(found))  # a union type reports a value once per member


def settings_table(model: type[pydantic.BaseModel]) -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting of ``model``, in declaration order."""
    rows = []
    for name, f in model.model_fields.items():
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

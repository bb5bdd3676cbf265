"""Settings: every environment variable the server reads, read here and nowhere else.

``Settings.from_env()`` reads the ``STREAMSCOPE_*`` variables once, at ``create_app()``,
so that ``hypercorn -k trio app:app`` needs no arguments. ``Settings`` is a
pydantic-settings model: each field is one variable (``STREAMSCOPE_`` + its name in
capitals), validated once, by its type and constraints. A bad value, an inconsistent
pair, or an unknown ``STREAMSCOPE_`` name (a typo would otherwise be ignored silently)
fails at startup with one ``SettingsError`` that names every problem; an empty value
counts as unset. ``Settings(...)`` in code (tests) is validated the same way and reads no
environment. Importing this module reads nothing. It knows no Quart, no engine internals.

The hub's limits (queue_limit, stall_timeout_s, max_waiting) are checked by the hub's own
``streams.HubSettings`` (one place says what the hub accepts), each as its variable is
read so that the error names it; the ``HubSettings`` the hub then runs with is built
with the settings, once, and never checked again.

This module says what can be set for the service and what is valid;
``settings_engine.py`` the engine's part (``EngineSettings``, which ``Settings`` extends);
``settings_env.py`` reads the environment and words the problems. docs/settings.md is
``settings_table()`` (``python -m tools.settings_doc``): each field's description says
its meaning, so the page and the code cannot drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import pydantic
from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from streams import HubSettings, PolicyName

from .api_keys import ApiKey, all_keys, check_key, parse_api_keys
from .settings_bands import BandSettings
from .settings_env import (
    ENV_PREFIX,
    Milliseconds,
    PositiveInt,
    Seconds,
    SettingsError,
    env_name,
    problems,
    read_environ,
)
from .settings_env import setting as _setting
from .settings_env import settings_table as table_of

# A model name is an identifier in JSON and in URLs: printable ASCII, no spaces.
MAX_MODEL_NAME_CHARS = 256
_HUB_LIMITS = ("queue_limit", "stall_timeout_s", "max_waiting")
_SECRETS = frozenset({"api_key", "api_keys", "resume_store", "resume_secret",  # never echoed
                      "metrics_token"})



class Settings(BandSettings):
    """The server's configuration: the engine's (``EngineSettings``, first), the
    priority bands' (``BandSettings``), then the service's. Field ``name`` is read from
    ``STREAMSCOPE_NAME``.

    Raises:
        SettingsError: from the constructor, if a value is out of range.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, frozen=True, extra="forbid",
        validate_default=False, hide_input_in_errors=True,
    )
    _hub: HubSettings = PrivateAttr()  # built once, with the settings (hub_settings)

    model_name: str | None = _setting(None,
        "another name for the model on the OpenAI routes: /v1/models lists it after the "
        "model setting's value, and a request's `model` may be either (else 404 "
        "model_not_found); `*` accepts any `model` (answered with the served name)",
        shown="(none)")
    policy: PolicyName = _setting(PolicyName.PAUSE_DROP,
        "slow-reader policy: unbounded, pause, drop or pause-drop")
    request_policies: Annotated[frozenset[PolicyName], NoDecode] = _setting(
        frozenset({PolicyName.PAUSE_DROP, PolicyName.DROP}),
        "the policies a request's `policy` field may pick, comma-separated (others: 422)")
    ttft_deadline_ms: Milliseconds | None = _setting(None,
        "a time-to-first-token deadline in milliseconds for requests that give no "
        "`deadline_ms`: one whose first token the engine estimates later is refused at "
        "once with 429 deadline_unmeetable (Retry-After, the estimate in the body); one "
        "still waiting at its deadline ends with error deadline_missed; unset: none",
        shown="(off)")
    max_waiting: int = _setting(256,
        "open streams still waiting for their first token; more are refused with 429")
    queue_limit: int = _setting(32,
        "events queued for one reader before it counts as behind")
    stall_timeout_s: float = _setting(10.0,
        "seconds a reader may stay behind before a dropping policy ends it (slow_client)")
    keepalive_s: Seconds = _setting(15.0,
        "an SSE comment goes out on a stream that has sent nothing for this long")
    resume_grace_s: Seconds = _setting(30.0,
        "how long a resumable stream whose reader left keeps generating, its events "
        "logged, for a reader to resume it (`GET /v1/stream/<id>`); then it is cancelled")
    resume_max_bytes: PositiveInt = _setting(64 * 1024 * 1024,
        "most bytes of event logs held for resumable streams without a reader, "
        "server-wide; a detached stream that would pass it ends with error "
        "resume_log_full")
    attach_timeout_s: Seconds = _setting(5.0,
        "how long a stream made by POST /v1/requests waits for its first reader; none by "
        "then, and it is cancelled (its blocks released)")
    max_detached_streams: PositiveInt = _setting(64,
        "most resumable streams generating with no reader, server-wide; at it, a new "
        "resumable stream is refused with 429 too_many_detached")
    resume_store: str | None = _setting(None,
        "where resumable streams' event logs live: unset, this process's memory; "
        "redis://host:port/db, a Redis that several replicas share, so that a stream "
        "resumes on any of them (see Several replicas)", shown="(memory)", repr=False)
    resume_secret: Annotated[str, Field(min_length=32)] | None = _setting(None,
        "with resume_store (then required): the key every replica signs what it stores "
        "with (HMAC-SHA256), and checks what it reads: a spec or event that fails is "
        "refused (error unavailable); the same on every replica, at least 32 characters",
        shown="(none)", repr=False)
    resume_store_queue: PositiveInt = _setting(4096,
        "with resume_store: most commands queued for it while it does not keep up or "
        "answer; a resumable stream whose event would pass it ends with error unavailable")
    writer_lease_s: Seconds = _setting(3.0,
        "with resume_store: the lease of the replica generating (writing) a resumable "
        "stream, renewed every third of it; once it lapses (the replica died), a resume on "
        "another replica takes the stream over and continues it with the same tokens "
        "(STREAMSCOPE_OWNER_LEASE_S, its old name, is still read, with a warning)")
    max_new_tokens_limit: PositiveInt | None = _setting(None,
        "the operator's cap on a request's max_new_tokens (max_tokens, max_output_tokens; "
        "4xx above); unset: the model's context, which prompt and new tokens must fit "
        "together in any case (4xx naming both numbers)")
    default_max_new_tokens: PositiveInt | None = _setting(None,
        "max_new_tokens for a request that gives none; unset: what the model's context "
        "leaves after the prompt (as OpenAI and vLLM), capped by max_new_tokens_limit")
    max_body_bytes: PositiveInt = _setting(64 * 1024,
        "largest request body, by Content-Length and as read (413 above)")
    max_prompt_chars: PositiveInt = _setting(32_768,
        "longest prompt in characters (422 above); the token budget is checked too")
    api_key: str | None = _setting(None,
        "if set, every route but /health, /ready, /metrics and the page (/, /page.js) needs "
        "`Authorization: Bearer <key>` (401 without); visible ASCII, at least 32 characters",
        shown="(off)", repr=False)
    api_keys: Annotated[tuple[ApiKey, ...], NoDecode] = _setting((),
        "more API keys, each with its own name and optional limit on the streams it holds "
        'open (429 too_many_streams past it), a JSON list `[{"name": "ci", "key": "...", '
        '"max_streams": 4}]`; a key\'s streams and requests are its own (404 for another key)',
        shown="(none)", repr=False)
    stream_token_ttl_s: Seconds = _setting(3600.0,
        "how long the read token in a stream_url (`?token=`, made with a key) opens its "
        "stream")
    shutdown_grace_s: Seconds = _setting(5.0,
        "the drain deadline: after SIGTERM, how long open streams may finish before they "
        "get error shutdown (with a Redis resume store, resumable ones are handed over to "
        "another replica 0.5 s before); hypercorn's --graceful-timeout must be at least "
        "this + 1")
    # -- fair shares between API keys (app/key_shares.py) --
    key_max_streams: PositiveInt = _setting(64,
        "most streams an API key holds open at once, STREAMSCOPE_API_KEY's too, where "
        "its api_keys entry sets no max_streams (429 too_many_streams past it)")
    # -- structured output and tool calls (issue 35; app/schemas/tools.py) --
    max_tools: PositiveInt = _setting(64,
        "most tools (functions) one request may offer (400 above)")
    max_schema_bytes: PositiveInt = _setting(32 * 1024,
        "largest JSON schema a request may constrain its answer with, as compact JSON: "
        "response_format's, or its tools' parameters together (400 above); a schema is "
        "compiled before the request is accepted")
    # -- the Responses API (POST /v1/responses): stored responses --------------------------
    responses_ttl_s: Seconds = _setting(3600.0,
        "how long a stored response (`store`, the default, and every background one) is "
        "kept after its last change, in the resume store (memory, or the shared Redis)")
    responses_max_stored: PositiveInt = _setting(1000,
        "most responses one API key (or, without keys, the server) keeps stored; past it "
        "a request with `store` is refused with 429 too_many_stored")
    responses_max_bytes: PositiveInt = _setting(16 * 1024 * 1024,
        "most bytes of stored responses (response objects and input items) one API key "
        "(or, without keys, the server) keeps; past it, 429 too_many_stored")
    responses_background_s: Seconds = _setting(600.0,
        "how long a background response may generate with no reader before it is "
        "cancelled (if longer than resume_grace_s); its events are kept resume_grace_s "
        "after its end, its response object responses_ttl_s")

    def __init__(self, **values: Any) -> None:
        """Validate ``values`` (the defaults for the rest); no environment is read.

        Raises:
            SettingsError: naming every bad value.
        """
        try:
            super().__init__(**values)
        except pydantic.ValidationError as exc:
            raise SettingsError(problems(exc, env_name=env_name, secrets=_SECRETS)) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Settings made in code take only what they are given; the environment is read by
        # from_env alone, once, so that a test's settings never pick up a stray variable.
        return (init_settings,)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every ``STREAMSCOPE_*`` variable of ``environ`` (default ``os.environ``).

        Raises:
            SettingsError: naming every unknown variable and every bad value.
        """
        return read_environ(cls, os.environ if environ is None else environ)

    def hub_settings(self) -> HubSettings:
        """The hub's policy and limits, as checked when these settings were made."""
        return self._hub

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes``, validated as a new one is."""
        return type(self)(**{**{n: getattr(self, n) for n in type(self).model_fields},
                             **changes})

    # -- validation beyond the types --------------------------------------------------

    @field_validator("policy", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("request_policies", "allowed_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return frozenset(p.strip().lower() for p in value.split(",") if p.strip())
        return value

    @field_validator(*_HUB_LIMITS)
    @classmethod
    def _hub_limit(cls, value: Any, info: ValidationInfo) -> Any:
        HubSettings(**{str(info.field_name): value})  # raises ValueError saying why
        return value

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, value: str | None) -> str | None:
        if value is None or (len(value) <= MAX_MODEL_NAME_CHARS and _visible_ascii(value)):
            return value
        raise ValueError(f"expected printable ASCII without spaces, at most "
                         f"{MAX_MODEL_NAME_CHARS} characters, or *")

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_endpoint(cls, value: str | None) -> str | None:
        if value is None or (urlsplit(value).scheme in ("http", "https")
                             and urlsplit(value).hostname):
            return value
        raise ValueError("expected an http:// or https:// URL (an OTLP/HTTP collector)")

    @field_validator("resume_store")
    @classmethod
    def _resume_store(cls, value: str | None) -> str | None:
        if value is None or (urlsplit(value).scheme in ("redis", "rediss", "unix")
                             and "://" in value):
            return value
        raise ValueError("expected redis://host:port/db (or rediss://, unix://)")

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, value: str | None) -> str | None:
        return None if value is None else check_key(value)  # app/api_keys.py

    @field_validator("api_keys", mode="before")
    @classmethod
    def _api_keys(cls, value: object) -> tuple[ApiKey, ...]:
        return parse_api_keys(value)  # JSON text, or in code a list

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if (self.default_max_new_tokens is not None and self.max_new_tokens_limit is not None
                and self.default_max_new_tokens > self.max_new_tokens_limit):
            raise ValueError(
                f"{env_name('default_max_new_tokens')} ({self.default_max_new_tokens}) must "
                f"not exceed {env_name('max_new_tokens_limit')} ({self.max_new_tokens_limit})")
        names = {k.name for k in all_keys(self.api_key, self.api_keys)}  # raises for twice
        unknown = sorted({name for name, _ in self.priority_ceilings} - names)
        if unknown:
            raise ValueError(f"{env_name('priority_ceilings')} names no API key of this "
                             f"server: {', '.join(unknown)}")
        if self.resume_store is not None and self.resume_secret is None:
            raise ValueError(f"{env_name('resume_store')} needs {env_name('resume_secret')}: "
                             "the same secret of at least 32 characters on every replica, "
                             "which signs what they store (make one with python -c 'import "
                             "secrets; print(secrets.token_hex(32))')")
        self._hub = HubSettings(  # each limit checked as it was read: this cannot fail
            policy=self.policy, queue_limit=self.queue_limit,
            stall_timeout_s=self.stall_timeout_s, max_waiting=self.max_waiting,
            shutdown_grace_s=self.shutdown_grace_s)
        return self

    # -- tenant isolation (docs/security.md) --
    metrics_token: Annotated[str, Field(min_length=32)] | None = _setting(None,
        "GET /metrics needs Authorization: Bearer <this> (at least 32 characters); unset: "
        "/metrics is open but leaves out the prefix-cache series", shown="(none)", repr=False)
    # -- tenants apart, small items (issue 33: chat caps, Host check) -------------------
    max_chat_messages: PositiveInt = _setting(512,
        "most messages one chat request may carry (OpenAI chat, Anthropic messages and "
        "count_tokens; a system prompt counts as one): 400 above, before any rendering")
    max_content_parts: PositiveInt = _setting(1024,
        "most text parts (content blocks) one chat request may carry, all messages and the "
        "system prompt together: 400 above")
    allowed_hosts: Annotated[frozenset[str], NoDecode] = _setting(frozenset(),
        "with no API key set, the Host names (comma-separated, port optional) answered "
        "besides localhost, 127.0.0.1 and [::1]; others get 400 (DNS rebinding); `*`: any",
        shown="(none)")
    # -- the scope: the live page of the batch (/scope, app/routes/scope.py; docs/scope.md) --
    scope_operator_keys: Annotated[frozenset[str], NoDecode] = _setting(frozenset(),
        "names of the API keys (`default` for STREAMSCOPE_API_KEY) that see every stream "
        "on /scope, comma-separated; any other key sees its own streams' rows and the "
        "server's steps and block pool; without keys /scope is open, like /stats",
        shown="(none)")
    scope_show_text: bool = _setting(False,
        "/scope's rows carry each stream's latest generated text (its last 80 "
        "characters); off: no text of any request appears on /scope")

    # Each watcher costs every step a write of each frame (its bytes are encoded once per
    # view and shared): a GET takes no stream slot, so these caps bound what watching
    # costs the streams (docs/security.md, What a watcher costs).
    scope_max_watchers: PositiveInt = _setting(64,
        "most /scope/events watchers open at once, server-wide; past it a new one is "
        "refused with 429 too_many_watchers before the stream")
    scope_key_watchers: PositiveInt = _setting(4,
        "most /scope/events watchers one API key may hold open (a key named in "
        "STREAMSCOPE_SCOPE_OPERATOR_KEYS: STREAMSCOPE_SCOPE_OPERATOR_WATCHERS); past it "
        "429 too_many_watchers")
    scope_operator_watchers: PositiveInt = _setting(16,
        "most /scope/events watchers an operator key (STREAMSCOPE_SCOPE_OPERATOR_KEYS) "
        "may hold open; past it 429 too_many_watchers")
    # -- traces and request logs (issue 47; app/tracing.py, app/request_log.py) ----------
    otlp_endpoint: str | None = _setting(None,
        "an OpenTelemetry collector's OTLP/HTTP base URL (`http://collector:4318`; "
        "`/v1/traces` is appended unless given): one span per request is exported there, "
        "with the GenAI attributes and a child of the request's `traceparent`; unset: no "
        "tracing, and OpenTelemetry is not imported (OTEL_EXPORTER_OTLP_ENDPOINT does not "
        "turn it on; the exporter's other OTEL_* variables, such as its headers, apply)",
        shown="(off)")
    log_format: Literal["text", "json"] = _setting("text",
        "`text`: the server's log lines for a terminal; `json`: every streamscope log line "
        "is a JSON object, and each request ends with one (its id, key name, route, status, "
        "tokens, TTFT, finish, replica, trace id; never its text)")
    replica: str | None = _setting(None,
        "this replica's name in request log lines and spans (`service.instance.id`)",
        shown="(the host's name)")

    @field_validator("scope_operator_keys", mode="before")
    @classmethod
    def _key_names(cls, value: object) -> object:
        if isinstance(value, str):
            return frozenset(n.strip() for n in value.split(",") if n.strip())
        return value


def settings_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting, in declaration order."""
    return table_of(Settings)


def _visible_ascii(value: str) -> bool:
    return all("!" <= c <= "~" for c in value)

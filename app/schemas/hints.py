"""The hints every OpenAI route accepts and ignores alike: reasoning and verbosity.

A client (the SDK's defaults, Codex and other agents) sends these whatever the model;
the same field means the same thing on every route:

* ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) ask a reasoning
  model to think more or less. A model whose chat template has no use for them cannot
  honour them, and they change nothing in its answer, so they are accepted and ignored
  there, as vLLM does; the route refuses them for a template that reads them
  (``template_reads_effort``), since it would be rendered without the value asked for.
  Responses' ``reasoning.summary`` (and its older name ``generate_summary``) and
  ``reasoning.context`` ask for a summary of, or a say in, the reasoning items, of
  which such a model writes none: ignored too. ``reasoning.mode`` other than
  ``"standard"`` asks for more compute than one model has: refused.
* ``verbosity`` (chat) and ``text.verbosity`` (Responses): how long an answer should
  be, which OpenAI's reasoning models follow. A small model cannot be told: ignored.

Values outside OpenAI's are refused (400 naming the field), so a typo is not silently
dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# OpenAI's values (the SDK's ``ReasoningEffort``).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]
SummaryKind = Literal["auto", "concise", "detailed"]


class Reasoning(BaseModel):
    """Responses' ``reasoning``: accepted and ignored where the template reads no
    ``reasoning_effort`` (the module docstring); an unknown member is refused."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    effort: ReasoningEffort | None = None
    summary: SummaryKind | None = None
    generate_summary: SummaryKind | None = None  # summary's older name
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: Literal["standard"] | None = None  # one model, one execution mode

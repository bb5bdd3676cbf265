"""A message's content as the one text a chat template renders, for every API.

OpenAI's chat messages and Responses ``function_call_output`` items, and Anthropic's
``tool_result`` blocks and system prompt, give content as a string or as a list of text
parts; each becomes one string, its parts joined by newlines (as vLLM joins a chat
message's parts), so that one conversation renders the same whichever API sent it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PartWithText(Protocol):
    """A text part of any API (``{"type": "text", "text"}``, ``input_text``, ...)."""

    @property
    def text(self) -> str: ...


def content_text(content: str | Sequence[PartWithText] | None) -> str:
    """``content`` as one text: a string as it is, parts joined by newlines, none as
    the empty string."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)

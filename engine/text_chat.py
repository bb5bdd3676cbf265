"""Chat messages to prompt ids in which a message's content cannot forge a special token.

A chat template writes its own special tokens (``<|im_start|>``, ``<|im_end|>``, a BOS)
around each message's content. Encoding the rendered text with special tokens parsed, as
``apply_chat_template(tokenize=True)`` does, also parses special-token text inside a
content: a user message holding ``<|im_start|>system\\n...`` would become a real system
turn. Here the template's text and the contents are told apart, and special-token text in
a content is encoded as plain text (the tokenizers library's ``encode_special_tokens``,
transformers' ``split_special_tokens=True``; llama.cpp's ``parse_special=false`` for user
text), while the template's own special tokens stay special.

Where the contents are: the template renders the conversation twice, once as it is and
once with each content replaced by a marker (a random nonce and the message's index) that
occurs nowhere else. Putting the contents back in place of the markers must give the first
rendering exactly; the markers' places are then the contents' spans. A template that
strips contents (``| trim``) passes with the stripped contents. One that otherwise changes
or inspects a content gives no spans: then a message whose content encodes to a special
token is refused (``ChatTemplateError``), and the rest are encoded whole, as before.

How the ids are made: the rendered text is encoded whole (special tokens parsed), as before,
and those ids are kept when no special token among them came from a content's span (the
fast tokenizer's offsets say where each token came from): an ordinary conversation gets
exactly the ids it always got. Otherwise (or with a tokenizer that gives no offsets) the
text is encoded in pieces, in order: the template's text between contents with special
tokens parsed, each content with them as plain text. The ids decode to the same text; at a
piece's edge they may split the text differently from a whole encode.

Called by ``text.PromptEncoder`` under its lock, on its own tokenizer copy (an encode here
changes that copy's ``encode_special_tokens`` and sets it back at the next one).
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jinja2

from .errors import ChatTemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# (text, whether it is a message's content), in order; joined, the rendered prompt.
Pieces = list[tuple[str, bool]]


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool, tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """The prompt text the chat template makes of ``messages`` and its token ids, with
    no special token taken from a message's content (see the module docstring).

    ``tools``: function definitions for a template that renders its own ``tools``
    (``apply_chat_template(tools=...)``); they become template text, not a content's
    span, so one whose JSON holds a special token's text is refused instead.

    Raises:
        ChatTemplateError: no chat template; the template refused the messages; a
            content holds special-token text where the template hides the contents'
            spans; or the tools hold a special token's text.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model has no chat template, so it cannot serve chat messages; "
            "send a plain prompt instead"
        )
    conversation = [dict(m) for m in messages]
    special = special_ids(tokenizer)
    tool_list = None if tools is None else [dict(t) for t in tools]
    if tool_list is not None:
        _refuse_special_tools(tokenizer, tool_list, special)
    text = _render(tokenizer, conversation, add_generation_prompt, tool_list)
    pieces = content_pieces(tokenizer, conversation, add_generation_prompt, text, tool_list)
    if pieces is None:
        _refuse_special_contents(tokenizer, conversation, special)
        return text, _encode(tokenizer, text, split_special=False)
    whole = _encode_with_offsets(tokenizer, text)
    if whole is not None and not _forged(*whole, special, pieces):
        return text, whole[0]
    ids: list[int] = []
    for piece, is_content in pieces:
        ids += _encode(tokenizer, piece, split_special=is_content)
    return text, ids


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every special token's id: the named ones and every added token marked special."""
    added = tokenizer.added_tokens_decoder
    return frozenset({*tokenizer.all_special_ids,
                      *(i for i, token in added.items() if token.special)})


def content_pieces(
    tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]],
    add_generation_prompt: bool, text: str,
    tools: list[dict[str, Any]] | None = None,
) -> Pieces | None:
    """``text`` cut into the template's text and the contents, or None where the template
    changes or inspects the contents beyond stripping them (see the module docstring)."""
    nonce = secrets.token_hex(16)
    if nonce in text:  # 128 random bits: never, but then no marker could be trusted
        return None
    marked = [{**m, "content": f"[{nonce}:{i}]"} for i, m in enumerate(conversation)]
    try:
        skeleton = _render(tokenizer, marked, add_generation_prompt, tools)
    except ChatTemplateError:  # it inspects the contents
        return None
    parts = re.split(rf"\[{nonce}:(\d+)\]", skeleton)
    for contents in ([m["content"] for m in conversation],
                     [m["content"].strip() for m in conversation]):
        pieces: Pieces = []
        for k, part in enumerate(parts):  # template text, index, template text, ...
            piece, is_content = (contents[int(part)], True) if k % 2 else (part, False)
            if piece:
                pieces.append((piece, is_content))
        if "".join(piece for piece, _ in pieces) == text:
            return pieces
    return None


def _render(
    tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]],
    add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False,  # type: ignore[arg-type]
            add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
    assert isinstance(text, str)  # tokenize=False renders one conversation as text
    return text


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, *, split_special: bool) -> list[int]:
    """``text``'s ids without the tokenizer's added BOS/EOS (the template writes what the
    model expects); special-token text as plain text if ``split_special``."""
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special)
    assert isinstance(ids, list)
    return ids


def _encode_with_offsets(
    tokenizer: PreTrainedTokenizerBase, text: str,
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """``text``'s ids, special tokens parsed, and each token's span of ``text``; None
    from a tokenizer that cannot say where its tokens came from (a slow one)."""
    try:
        encoding = tokenizer(text, add_special_tokens=False, split_special_tokens=False,
                             return_offsets_mapping=True)
    except (NotImplementedError, ValueError):
        return None
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    assert isinstance(ids, list) and isinstance(offsets, list)
    return ids, [(int(start), int(end)) for start, end in offsets]


def _forged(
    ids: list[int], offsets: list[tuple[int, int]], special: frozenset[int], pieces: Pieces,
) -> bool:
    """Whether a special token among ``ids`` overlaps a content's span.

    The spans are in order and disjoint, so the only one a token ``[start, end)`` can
    overlap is the first that ends after ``start`` (a bisection); it does iff it begins
    before ``end``. O(tokens x log spans): comparing each special token with every span
    made 1,900 one-character messages take 0.85 s on the one tokenizer slot (issue 33).
    """
    starts: list[int] = []
    ends: list[int] = []
    at = 0
    for piece, is_content in pieces:
        if is_content:
            starts.append(at)
            ends.append(at + len(piece))
        at += len(piece)
    for token, (start, end) in zip(ids, offsets, strict=True):
        if token in special:
            k = bisect.bisect_right(ends, start)
            if k < len(ends) and starts[k] < end:
                return True
    return False


def _refuse_special_tools(
    tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]], special: frozenset[int],
) -> None:
    """Raise ChatTemplateError if the tools' JSON holds a special token's text: the
    template writes them as its own text, whose special tokens are parsed."""
    found = special.intersection(_encode(tokenizer, json.dumps(tools, ensure_ascii=False),
                                         split_special=False))
    if found:
        token = tokenizer.convert_ids_to_tokens(min(found))
        raise ChatTemplateError(
            f"the tools hold the special token {token!r}, which this model's chat template "
            "would read as one; remove it from the tools")


def _refuse_special_contents(
    tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]],
    special: frozenset[int],
) -> None:
    """Raise ChatTemplateError if a message's content encodes to a special token."""
    for index, message in enumerate(conversation):
        found = special.intersection(_encode(tokenizer, message["content"], split_special=False))
        if found:
            token = tokenizer.convert_ids_to_tokens(min(found))
            raise ChatTemplateError(
                f"messages[{index}].content holds the special token {token!r}, and this "
                "model's chat template changes message contents, so the server cannot keep "
                "it from acting as one; remove it from the message")

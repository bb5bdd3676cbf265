"""Turning token ids into text deltas, and ending on stop strings.

``IncrementalDetokenizer`` follows the prefix/read-offset scheme of TGI and
vLLM: it decodes a short window of recent tokens twice (with and without the
newest) and emits the difference, holding it back while the window ends in an
incomplete UTF-8 character (decoded as U+FFFD). Decoding a window rather than
single tokens keeps the tokenizer's joining rules (spaces, byte fallback).

``StopMatcher`` finds stop strings in the text across token boundaries. It
holds back the longest tail that could still grow into a stop string, so a
stop string split over two tokens is never partly emitted.

``PromptEncoder`` turns prompts into token ids from any thread. A fast
(Rust) tokenizer must not be used from two threads at once (the tokenizers
library raises ``RuntimeError: Already borrowed`` when a call that changes its
settings meets another call), and the step thread decodes with the model's
tokenizer all the time; so prompts are encoded with a copy of it, one call at
a time under the encoder's own lock. The step never waits for an encode. Chat
messages become a prompt there too (``render_chat``): the tokenizer's own chat
template (Jinja, in the tokenizer's config or the GGUF file) renders them, and
``text_chat`` encodes them so that no message's content can forge a special token.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from .errors import PromptTooLong
from .text_chat import chat_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, as cheaply as it can be had.

    A fast tokenizer's decode is the Rust tokenizer's, then, only if the tokenizer says
    so, a clean-up of spaces that transformers skips for BPE models anyway. Where that
    clean-up cannot apply, the Rust decode is called directly: the same text (a test
    compares them on random ids), about 2 us a call instead of 6 through transformers'
    layers, and the detokenizer calls it twice a token (``tools.bench step``'s step
    decodes every row).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False) and not (
        backend is not None and type(backend.model).__name__ == "BPE"
        and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_"
                                   "will_corrupt_output", False))
    if backend is not None and not cleans_up:
        return partial(backend.decode, skip_special_tokens=True)

    def decode(ids: list[int]) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # a list only for batched input
        return text

    return decode


class IncrementalDetokenizer:
    """Text deltas for one sequence's generated tokens.

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt, for context (its last few tokens).
        decode: ``text_decoder(tokenizer)``, made once for many detokenizers.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int],
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self._decode = decode or text_decoder(tokenizer)
        # A few prompt tokens of context so the first generated token joins correctly.
        self._ids = list(prompt_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character: wait for its remaining bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """The held-back text at the end of the sequence (may hold U+FFFD)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :]


class StopMatcher:
    """Finds the first stop string in a stream of text deltas; ``matched`` says which.

    The text is cut where the earliest stop string begins; of two that begin at the
    same place (one a prefix of the other) the shorter is the one matched, the first
    that was complete.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once found

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit, stopped). After a stop, the rest is dropped."""
        if not self._stops:
            return delta, False
        text = self._held + delta
        found = [(i, len(s), s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            self._held = ""
            start, _, self.matched = min(found)
            return text[:start], True
        keep = max(self._partial_len(text, s) for s in self._stops)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    @staticmethod
    def _partial_len(text: str, stop: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of ``stop``."""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                return n
        return 0


class PromptEncoder:
    """Token ids of prompts, callable from any thread; never touches the decoding tokenizer.

    Args:
        tokenizer: the model's tokenizer; the encoder keeps its own deep copy (for the
            embedded model, about 0.15 s and a few MB, once per engine).
        max_tokens: the most tokens a prompt can have (the model's context): chat
            messages surely over it are refused before the template runs.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_tokens: int | None = None) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()  # one encode at a time on this copy
        self._max_tokens = max_tokens
        self._token_chars = longest_token_chars(tokenizer)

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids (empty for an empty text). Blocks while another
        thread encodes; a 32k-character prompt takes tens of milliseconds."""
        if not text:
            return []
        with self._lock:
            ids = self._tokenizer.encode(text)
        assert isinstance(ids, list)
        return ids

    def encode_if_free(self, text: str) -> list[int] | None:
        """``encode(text)`` if no other thread is encoding now, else None at once."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            ids = self._tokenizer.encode(text) if text else []
        finally:
            self._lock.release()
        assert isinstance(ids, list)
        return ids

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text the chat template makes of ``messages`` (``{"role",
        "content"}`` each) and of ``tools`` (function definitions, for a template that
        renders its own), and its token ids (``text_chat.chat_prompt``).

        The ids are encoded without the tokenizer's added special tokens: the template
        writes every special token the model expects (a BOS among them), as
        ``apply_chat_template(tokenize=True)`` does. Special-token text inside a
        message's content is encoded as plain text: a message cannot forge a turn.

        Raises:
            ChatTemplateError: the tokenizer has no chat template, rendering failed (a
                template may raise on roles in an order it does not accept), or a content
                holds special-token text where the template hides the contents' spans.
        """
        floor = self.min_chat_tokens(messages)
        if self._max_tokens is not None and floor > self._max_tokens:
            raise PromptTooLong(
                f"the messages' text alone is at least {floor} tokens, over the model's "
                f"context of {self._max_tokens} tokens")
        with self._lock:
            return chat_prompt(self._tokenizer, messages, add_generation_prompt, tools)

    def min_chat_tokens(self, messages: Sequence[Mapping[str, str]]) -> int:
        """A floor on the tokens of ``messages`` rendered, from their characters alone, in
        time linear in their text and with no tokenizer call: no token covers more than
        the longest token's characters, and the rendered prompt holds every content
        (stripped: a template may ``trim``). 0 where no such bound is known."""
        if self._token_chars is None:
            return 0
        return sum(len(m["content"].strip()) for m in messages) // self._token_chars


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most characters of text one token can stand for: its vocabulary's longest
    token string (byte-level BPE writes a byte as a character; SentencePiece's ``▁`` is
    a space; WordPiece's ``##`` is extra), or None where a normalizer may shorten the
    text first (NFC, stripping, ...) or there is no fast tokenizer to ask."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=0) or None

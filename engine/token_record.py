"""Turning a sampled token into what its event says: text, an end, log-probabilities.

``TokenRecorder.read`` runs one sampled token (or the exception sampling it raised)
through the sequence's constraint matcher (``constraints.advance``), detokenizer and
stop matcher, decides whether the sequence ends with it (a stop string, eos, the
length, the end of its constraint's grammar) and gives a row's log-probabilities their
event form (``logprobs``, texts by ``token_text``). It raises whatever any of those
raised: the scheduler's ``record_token`` is the per-sequence error boundary that turns
that into an ``ERROR`` finish of that sequence alone, and owns the rest (appending the
token, the prefix cache, the finish that releases blocks).

``replay`` brings a rebuilt sequence (a stream resumed from tokens made elsewhere) to
where it was after its generated tokens, silently: their events went out where they
were made. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .constraints import advance
from .logprobs import Outcome, Sampled, event_logprobs, token_id_of
from .sequence import Sequence
from .types import FinishReason, TokenLogprobs


@dataclass(frozen=True, slots=True)
class Reading:
    """What one sampled token makes: its id, the text it adds, why the sequence ends
    with it (None: it goes on), and its log-probabilities if the request asked."""

    token_id: int
    text: str
    reason: FinishReason | None
    logprobs: TokenLogprobs | None


class TokenRecorder:
    """Reads sampled tokens for the stepping thread.

    Args:
        eos_token_ids: tokens that end a sequence (unless its request ignores eos).
    """

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self.token_text: Callable[[int], str] = str  # the engine's: logprobs.TokenTexts

    def read(self, seq: Sequence, token: Outcome, index: int) -> Reading:
        """Token ``index`` of ``seq`` read, or the exception that made it (raised)."""
        if isinstance(token, Exception):
            raise token
        token_id = token_id_of(token)
        ended = seq.matcher is not None and advance(seq.matcher, token_id)
        text, reason = self.text_of(seq, token_id, index, ended)
        logprobs = event_logprobs(token, self.token_text) if isinstance(token, Sampled) else None
        return Reading(token_id, text, reason, logprobs)

    def replay(self, seq: Sequence) -> tuple[FinishReason, str | None] | None:
        """Feed a rebuilt sequence's generated tokens through its detokenizer and stop
        matcher with no event; the finish (reason, error) if those tokens already end
        it (the finish was lost, or replaying failed), else None."""
        for index, token in enumerate(seq.generated_ids):
            try:
                ended = seq.matcher is not None and advance(seq.matcher, token)
                _, reason = self.text_of(seq, token, index, ended)
            except Exception as exc:
                return FinishReason.ERROR, f"replaying token {index} failed: {exc!r}"
            if reason is not None:
                return reason, None
        return None

    def text_of(self, seq: Sequence, token_id: int, index: int,
                grammar_ended: bool = False) -> tuple[str, FinishReason | None]:
        """The text token ``index`` adds, and why the sequence ends with it (or None):
        ``grammar_ended`` (its constraint allows nothing more) is a STOP."""
        text, stopped = seq.stop_matcher.feed(seq.detokenizer.add(token_id))
        if stopped:
            return text, FinishReason.STOP
        is_eos = token_id in self.eos_token_ids and not seq.request.sampling.ignore_eos
        if not (is_eos or grammar_ended or index + 1 == seq.request.max_new_tokens):
            return text, None
        tail, stopped = seq.stop_matcher.feed(seq.detokenizer.flush())
        if stopped:
            return text + tail, FinishReason.STOP
        text += tail + seq.stop_matcher.flush()
        if is_eos:
            return text, FinishReason.EOS
        return text, FinishReason.STOP if grammar_ended else FinishReason.LENGTH

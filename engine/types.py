"""Plain frozen data that crosses the engine's boundary.

Everything the rest of the program learns from the engine, and everything it
asks of it, is one of these types: request ids, token ids, text deltas, finish
reasons and counters. No tensors leave ``engine/``; no Trio object enters it.
This module imports neither torch nor transformers, so ``streams/`` may use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    """Why a sequence left the engine."""

    EOS = "eos"  # the model produced an end-of-sequence token
    LENGTH = "length"  # max_new_tokens were generated
    STOP = "stop"  # a stop string appeared in the text (it is not emitted)
    CANCELLED = "cancelled"  # cancel() was applied at a step boundary
    ERROR = "error"  # the forward pass, sampling or detokenizing failed for this sequence
    DEADLINE = "deadline"  # its ttft_deadline passed before its prefill began: never run


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its next token.

    ``temperature == 0`` is greedy. With a ``seed`` a sampled request draws
    from its own generator, so its tokens do not depend on its batch mates.
    With ``logprobs`` each of its ``TokenEvent``s carries ``TokenLogprobs``.

    The penalties and ``logit_bias`` change the row's logits before anything else
    reads them (``engine.penalties``; greedy and sampled alike, the log-probabilities
    too): ``logit_bias`` adds each (token id, bias) pair's bias (OpenAI's); then
    ``repetition_penalty`` (vLLM's) divides a positive logit, and multiplies a negative
    one, by it for every token in the prompt or generated so far; then
    ``frequency_penalty`` times the token's count among the generated tokens, and
    ``presence_penalty`` once if it is there at all, are subtracted (OpenAI's).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    ignore_eos: bool = False  # for fixed-length benchmarks
    logprobs: bool = False  # each token's log-probability (``TokenLogprobs``)
    top_logprobs: int = 0  # and the likeliest this many tokens' (needs ``logprobs``)
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: 0 changes nothing
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: 0 changes nothing
    repetition_penalty: float = 1.0  # vLLM's, > 0: 1 changes nothing
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])

    @property
    def changes_logits(self) -> bool:
        """Whether a penalty or a bias applies (``engine.penalties``): False keeps the
        row off that work entirely."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)


class ConstraintKind(enum.Enum):
    """What a ``Constraint``'s source is."""

    JSON_SCHEMA = "json_schema"  # a JSON schema (its JSON text): the output is a document of it
    JSON_OBJECT = "json_object"  # any JSON object (the source is ignored)
    REGEX = "regex"  # a regular expression the whole output matches
    GRAMMAR = "grammar"  # a Lark grammar (llguidance's dialect: ``start`` is the rule)


@dataclass(frozen=True, slots=True)
class Constraint:
    """The form a request's output must take (``engine.constraints``): every token is
    sampled from those the form allows next, eos only where it may end."""

    kind: ConstraintKind
    source: str = ""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as submitted to the engine.

    ``prompt_token_ids``, when given, are the prompt's token ids as the engine's own
    ``tokenize(prompt)`` returned them: the engine then does not encode the prompt
    again, so a caller can encode it in advance, off its event loop.

    ``cache_namespace``: the prefix cache's namespace, opaque bytes (at most
    ``MAX_NAMESPACE_BYTES``): the request's block identities chain from a root derived
    from it (``prefix_cache.root_of``), so it shares cached blocks only with requests of
    the same namespace. The app derives one per API key (and ``cache_salt``).
    """

    request_id: str
    prompt: str
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: tuple[int, ...] | None = None
    # When the first token is due, in time.monotonic() seconds (None: no deadline). A
    # request still waiting then, its prefill not begun, is finished with DEADLINE at
    # the next step boundary (``Scheduler.expire_deadlines``).
    ttft_deadline: float | None = None
    cache_namespace: bytes = b""
    # The form the output must take (None: free text).
    constraint: Constraint | None = None
    # Its band (vLLM's ``priority``: lower is sooner; ``engine.priority``): the waiting
    # queue is ordered by it, and a waiting lower value preempts a running higher one.
    priority: int = 0
    # Whose work it is, for fair shares by tokens served within a band (the app passes
    # the API key's name): "" for everyone else.
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability, and the likeliest tokens' at its position.

    Natural logs of the distribution the token was drawn from: ``log_softmax`` of the
    step's logits (after the request's penalties and logit bias, if any) divided by the
    request's temperature (a greedy request's: of the logits themselves), before its
    top-k and top-p cut, so every token has one and it
    does not depend on the cut. A token the model rules out is reported at
    ``MIN_LOGPROB`` (-9999.0, as OpenAI does), so every value is a finite number. Texts
    are each token decoded alone by the tokenizer: special tokens as their text, a
    token that holds only part of a character with U+FFFD in its place.
    """

    token: str  # the generated token's own text (``TokenEvent.text`` is the delta)
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, text, logprob), likeliest first


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token and the text it adds.

    ``text`` may be empty while bytes of an incomplete character or a possible
    stop-string prefix are held back; the last token of a sequence that ends by
    ``eos`` or ``length`` carries whatever was held back. An end-of-sequence
    token is reported as a token (its own text is empty) and counted in usage.
    """

    request_id: str
    index: int  # 0 for the first generated token
    token_id: int
    text: str
    logprobs: TokenLogprobs | None = None  # with SamplingParams.logprobs, else None


@dataclass(frozen=True, slots=True)
class FinishEvent:
    """A sequence left the engine; its blocks are already released."""

    request_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # a message when reason is ERROR
    stop_sequence: str | None = None  # the stop string that matched, when reason is STOP
    # Prompt tokens found in the prefix cache when it was first admitted, so not
    # prefilled for it: what OpenAI's usage calls ``cached_tokens``.
    cached_tokens: int = 0


EngineEvent = TokenEvent | FinishEvent


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine's state, taken under its lock."""

    blocks_total: int
    blocks_free: int
    blocks_reserved: int  # held by running sequences (blocks_total - blocks_free)
    running: int
    waiting: int
    paused: int
    admitted: int  # sequences ever given blocks and a slot
    releases: int  # sequences whose blocks went back to the pool: == admitted when idle
    steps: int
    last_step_ms: float | None
    median_decode_step_ms: float | None  # over recent steps that decoded a batch
    blocks_filled: int = 0  # of the reserved, those holding a cached position
    preemptions: int = 0  # running sequences whose blocks were taken back (to recompute)
    recomputed_tokens: int = 0  # positions prefilled again after preemptions
    step_margin: float = 1.0  # a step target's planned steps: actual / planned (costs.margin)
    prefix_cache_queries: int = 0  # prompt positions looked up at admission (prefix cache)
    prefix_cache_hits: int = 0  # of those, found cached: not computed
    blocks_cached: int = 0  # committed full blocks, shared or evictable
    blocks_evicted: int = 0  # cached blocks reused for other positions (LRU)
    blocks_shared: int = 0  # referenced by more than one live table (a shared prefix)
    # The last step's plan (0 and () in a snapshot taken in a step, at a hand-over):
    last_step_decoded: int = 0  # rows the last step decoded
    last_step_prefilled: int = 0  # prompt positions the last step prefilled
    last_step_prefill_ids: tuple[str, ...] = ()  # the requests whose prompt it prefilled
    step_target_ms: float | None = None  # the step-time target (``max_step_ms``), if any
    # Per band (``GenerationRequest.priority``), as (band, value) pairs, bands ascending:
    waiting_by_band: tuple[tuple[int, int], ...] = ()  # sequences waiting now
    wait_ms_by_band: tuple[tuple[int, float], ...] = ()  # mean wait before first admission
    preemptions_by_band: tuple[tuple[int, int], ...] = ()  # sequences of it preempted
    priority_preemptions: int = 0  # of all preemptions, those for a higher band
    # Aging (``engine.aging``), per band: the most steps a sequence waited in the queue
    # before an admission (since it last entered it), and admissions lifted by aging.
    longest_wait_steps_by_band: tuple[tuple[int, int], ...] = ()
    aged_admissions_by_band: tuple[tuple[int, int], ...] = ()

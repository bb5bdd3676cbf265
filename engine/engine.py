"""The step-driven engine: continuous batching over a paged KV cache.

Theory of operation. The rest of the program talks to the engine through four
thread-safe methods, ``submit``, ``cancel``, ``pause`` and ``resume``, which
only record a wish in the inbox. Everything that changes a sequence or the
cache happens inside ``step()``, which one caller runs repeatedly:

1. apply the inbox: submits join the waiting queue, cancels finish a waiting
   sequence (never admitted) or a running one (blocks released), pauses and
   resumes flip a flag; with ``on_prefill``, the finishes go out at once;
2. admit waiting sequences in arrival order while there are batch slots and
   blocks, and run the prefills of admitted sequences, in arrival order, up to
   ``max_prefill_tokens`` prompt tokens (the rest next step); a prefill yields
   its first token, and with ``on_prefill`` it goes out as soon as that prefill
   is done;
3. decode one token for every other running, unpaused sequence in ONE batched
   forward pass;
4. return the events: tokens, and finishes with a reason.

A sequence is therefore never removed while its tensors are in use, and its
blocks are released in one place (``BlockAllocator.release``, which raises on
a second release). ``statistics()`` is a snapshot taken at the last step
boundary (and before events are handed to ``on_prefill``, so a finish its reader
has seen is always counted), so reading it never waits for a step.

Failures. A failure tied to one sequence (its prefill, its sampling, its
detokenizer or stop matcher) finishes that sequence alone with ``ERROR`` and a
message; a failed batched forward pass finishes the sequences in that batch.
Either way the step goes on and returns normally. Every event is handed out
exactly once, in ``on_prefill`` or in the return value: if ``on_prefill``
raises, the step stops there and the exception propagates, and every event
made until then was already handed to it (the rest of the step runs next time).

Prompts are encoded with ``tokenize`` (any thread, its own copy of the
tokenizer: see ``text.PromptEncoder``), or in ``submit``; detokenizing happens
only in the stepping thread, so no fast tokenizer is used by two threads.
"""

from __future__ import annotations

import enum
import statistics as stats
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from functools import partial

import torch

from . import sampling
from .attention import ATTENTION_NAME, PagedBatch, prefill_batch
from .errors import (
    DuplicateRequestId,
    EmptyPrompt,
    InvalidMaxNewTokens,
    PromptTooLong,
    StepReentered,
)
from .kv_cache import BlockAllocator, PagedKVCache
from .model import LoadedModel
from .scheduler import Scheduler
from .sequence import Sequence
from .text import IncrementalDetokenizer, PromptEncoder, StopMatcher
from .types import (
    EngineEvent,
    EngineStatistics,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    TokenEvent,
)

PrefillCallback = Callable[[list[EngineEvent]], None]

# Prompt tokens prefilled in one step. A prefill costs time roughly in proportion to
# its tokens, and every running stream waits for the whole step: a budget of about six
# of the experiments' prompts (34-45 tokens) per step bounds that wait, while a burst of
# 32 arrivals is still admitted within about six steps.
DEFAULT_MAX_PREFILL_TOKENS = 256


class _Op(enum.Enum):
    SUBMIT = "submit"  # payload: a new Sequence
    CANCEL = "cancel"  # payload: a request id
    PAUSE = "pause"
    RESUME = "resume"


class Engine:
    """A language model serving many sequences, one round per ``step()``.

    Args:
        loaded: the model and tokenizer (see ``engine.model.load_model``).
        max_batch: most sequences running at once (batch slots).
        num_blocks: KV-cache blocks, allocated once.
        block_size: positions per block.
        eos_token_ids: override the model's end-of-sequence ids.
        max_prefill_tokens: prompt tokens prefilled per step (at least one prompt).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch: int = 32,
        num_blocks: int = 512,
        block_size: int = 16,
        eos_token_ids: frozenset[int] | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
    ) -> None:
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError(
                f"max_batch ({max_batch}) and max_prefill_tokens "
                f"({max_prefill_tokens}) must be at least 1"
            )
        self.max_prefill_tokens = max_prefill_tokens
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer  # the stepping thread's: detokenizers use it
        self._encoder = PromptEncoder(loaded.tokenizer)
        self.device = loaded.device
        self.eos_token_ids = loaded.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.model.set_attn_implementation(ATTENTION_NAME)
        config = self.model.config
        num_heads = config.num_attention_heads
        self.cache = PagedKVCache(
            num_layers=config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            dtype=self.model.dtype,
            device=self.device,
        )
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.scheduler = Scheduler(self.allocator, max_batch)
        self._inbox: list[tuple[_Op, Sequence | str]] = []
        self._live_ids: set[str] = set()  # submitted and not yet finished
        self._inbox_lock = threading.Lock()  # guards _inbox and _live_ids
        self._step_lock = threading.Lock()  # one step at a time
        self._num_steps = 0
        self._last_step_ms: float | None = None
        self._decode_ms: deque[float] = deque(maxlen=256)
        self._snapshot = self._take_snapshot()

    # -- the thread-safe entry points: they only record a wish ---------------

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids, for ``GenerationRequest.prompt_token_ids``.

        Thread-safe, and never shares a tokenizer with the stepping thread; it blocks
        (a 32k-character prompt takes tens of milliseconds), so an event loop runs it
        in a worker thread.
        """
        return self._encoder.encode(prompt)

    def render_chat(
        self, messages: Seq[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> tuple[str, list[int]]:
        """Chat messages (``{"role", "content"}``) rendered by the tokenizer's own chat
        template: the prompt text and its token ids, for ``GenerationRequest.prompt`` and
        ``prompt_token_ids``. Thread-safe and blocking, like ``tokenize``.

        Raises:
            ChatTemplateError: the model has no chat template, or it refused the messages.
        """
        return self._encoder.render_chat(messages, add_generation_prompt)

    def submit(self, request: GenerationRequest) -> int:
        """Validate and queue a request; return its prompt's token count.

        The prompt is encoded here unless ``request.prompt_token_ids`` holds its ids.

        Raises:
            EmptyPrompt, InvalidMaxNewTokens, InvalidSampling, PromptTooLong,
            DuplicateRequestId: nothing was queued.
        """
        max_new = request.max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise InvalidMaxNewTokens(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
        sampling.validate(request.sampling)
        given = request.prompt_token_ids
        prompt_ids = list(given) if given is not None else self.tokenize(request.prompt)
        if not prompt_ids:
            raise EmptyPrompt("the prompt is empty")
        self.check_budget(len(prompt_ids), max_new)
        seq = Sequence(
            request=request,
            prompt_ids=prompt_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            stop_matcher=StopMatcher(tuple(request.stop)),
            generator=sampling.make_generator(request.sampling, self.device),
        )
        with self._inbox_lock:
            if request.request_id in self._live_ids:
                raise DuplicateRequestId(f"request id {request.request_id!r} is in use")
            self._live_ids.add(request.request_id)
            self._inbox.append((_Op.SUBMIT, seq))
        return len(prompt_ids)

    def check_budget(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise PromptTooLong if the request can never fit the cache or the model."""
        total = prompt_tokens + max_new_tokens
        limit = min(self.loaded.max_context, self.allocator.num_blocks * self.allocator.block_size)
        if total > limit:
            raise PromptTooLong(
                f"prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) "
                f"is {total}, over the limit of {limit} tokens"
            )

    def cancel(self, request_id: str) -> None:
        """Ask for a request to end at the next step boundary (idempotent)."""
        self._post(_Op.CANCEL, request_id)

    def pause(self, request_id: str) -> None:
        """Leave a running request out of decoding; it keeps its blocks and slot."""
        self._post(_Op.PAUSE, request_id)

    def resume(self, request_id: str) -> None:
        self._post(_Op.RESUME, request_id)

    def _post(self, op: _Op, request_id: str) -> None:
        with self._inbox_lock:
            self._inbox.append((op, request_id))

    # -- the step: only its one caller runs it --------------------------------

    def step(self, on_prefill: PrefillCallback | None = None) -> list[EngineEvent]:
        """Run one round (see the module docstring) and return its events.

        With ``on_prefill``, the finishes of cancels applied at the start of the step,
        then each prefill's events, are handed to it as soon as they are made; they
        are not repeated in the return value.

        Raises:
            StepReentered: another thread is inside step().
            Exception: whatever ``on_prefill`` raised. Every event made in this step
                was handed to ``on_prefill`` by then; no other event was made, and the
                prefills and decode not run yet run at the next step.
        """
        if not self._step_lock.acquire(blocking=False):
            raise StepReentered("step() is already running in another thread")
        try:
            started = time.perf_counter()
            events = self._apply_inbox()
            deliver = events.extend
            if on_prefill is not None:
                deliver = partial(self._hand_over, on_prefill)
                if events:
                    # Out first: once these are handed over, nothing made later can lose them.
                    handed, events = events, []
                    deliver(handed)
            self.scheduler.admit()
            fresh = self._prefills_this_step()
            for seq in fresh:
                deliver(self._prefill(seq))
            batch = [s for s in self.scheduler.decodable() if s not in fresh]
            if batch:
                events.extend(self._decode(batch))
            self._record_step(started, decoded=bool(batch), prefilled=bool(fresh))
            return events
        finally:
            self._step_lock.release()

    def _hand_over(self, on_prefill: PrefillCallback, events: list[EngineEvent]) -> None:
        """Give ``events`` to ``on_prefill`` with the statistics brought up to date first:
        whoever sees a finish then also sees its blocks released in ``statistics()``."""
        self._snapshot = self._take_snapshot()
        on_prefill(events)

    def _prefills_this_step(self) -> list[Sequence]:
        """Admitted sequences to prefill now, in arrival order, within the token budget.

        At least one, so a prompt longer than the budget still runs. The rest wait
        for later steps, so a burst of arrivals costs the running streams a few
        prefills per step rather than all of them at once. A sequence paused before
        its prefill waits too; one whose prefill was skipped because on_prefill
        raised in an earlier step gets it now.
        """
        chosen: list[Sequence] = []
        used = 0
        for seq in self.scheduler.prefillable():
            if chosen and used + seq.num_prompt_tokens > self.max_prefill_tokens:
                break
            chosen.append(seq)
            used += seq.num_prompt_tokens
        return chosen

    def has_work(self) -> bool:
        """Whether a step would do anything. For the step's caller, between steps."""
        with self._inbox_lock:
            if self._inbox:
                return True
        waiting = self.scheduler.waiting
        can_admit = bool(waiting) and (
            len(self.scheduler.running) < self.scheduler.max_batch
            and self.allocator.can_reserve(waiting[0].max_tokens)
        )
        return can_admit or bool(self.scheduler.prefillable() or self.scheduler.decodable())

    def statistics(self) -> EngineStatistics:
        """The state at the last step boundary."""
        return self._snapshot

    def _apply_inbox(self) -> list[EngineEvent]:
        with self._inbox_lock:
            ops, self._inbox = self._inbox, []
        events: list[EngineEvent] = []
        for op, payload in ops:
            if op is _Op.SUBMIT:
                assert isinstance(payload, Sequence)
                self.scheduler.add(payload)
                continue
            assert isinstance(payload, str)
            seq = self.scheduler.find(payload)
            if seq is None:
                continue  # unknown or already finished: nothing to do
            if op is _Op.CANCEL:
                events.append(self._finish(seq, FinishReason.CANCELLED))
            else:
                seq.is_paused = op is _Op.PAUSE
        return events

    # -- model work -----------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self, seq: Sequence) -> list[EngineEvent]:
        assert seq.block_table is not None
        try:
            n = seq.num_prompt_tokens
            positions = torch.arange(n, device=self.device).unsqueeze(0)
            tables = torch.tensor([seq.block_table.block_ids], device=self.device)
            batch = prefill_batch(self.cache, tables, positions)
            input_ids = torch.tensor([seq.prompt_ids], device=self.device)
            logits = self._forward(input_ids, positions, batch)
            greedy_ids = sampling.greedy(logits)
        except Exception as exc:  # a failed prefill ends this sequence only
            return [self._finish(seq, FinishReason.ERROR, error=f"prefill failed: {exc}")]
        return self._next_token(seq, logits[0], greedy_ids[0])

    @torch.inference_mode()
    def _decode(self, seqs: list[Sequence]) -> list[EngineEvent]:
        try:
            logits = self._decode_forward(seqs)
            greedy_ids = sampling.greedy(logits)
        except Exception as exc:  # a failed batch ends every sequence in it
            return [
                self._finish(s, FinishReason.ERROR, error=f"decode failed: {exc}") for s in seqs
            ]
        events: list[EngineEvent] = []
        for row, seq in enumerate(seqs):
            events.extend(self._next_token(seq, logits[row], greedy_ids[row]))
        return events

    def _decode_forward(self, seqs: list[Sequence]) -> torch.Tensor:
        device = self.device
        tables_list = [s.block_table.block_ids for s in seqs]  # type: ignore[union-attr]
        width = max(len(t) for t in tables_list)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in tables_list], device=device)
        positions = torch.tensor([[s.num_cached] for s in seqs], device=device)
        lengths = positions + 1
        span = torch.arange(int(lengths.max()), device=device).expand(len(seqs), -1)
        bias = torch.zeros(span.shape, dtype=self.model.dtype, device=device)
        batch = PagedBatch(
            self.cache,
            write_slots=self.cache.slots(tables, positions).flatten(),
            read_slots=self.cache.slots(tables, span).flatten(),
            read_bias=bias.masked_fill_(span >= lengths, float("-inf"))[:, None, None, :],
        )
        input_ids = torch.tensor([[s.last_token_id] for s in seqs], device=device)
        return self._forward(input_ids, positions, batch)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch
    ) -> torch.Tensor:
        """Logits of the last position of each row, (batch, vocab)."""
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            paged=batch,
            use_cache=False,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    # -- text and finishing ---------------------------------------------------

    def _next_token(self, seq: Sequence, logits: torch.Tensor, greedy_id: int) -> list[EngineEvent]:
        """Choose, record and detokenize one sequence's next token from its row of logits.

        The per-sequence error boundary: an exception from sampling, the detokenizer or
        the stop matcher finishes this sequence alone (ERROR, blocks released once), and
        the token it was making is not counted.
        """
        index = len(seq.generated_ids)
        try:
            token_id = sampling.choose(logits, seq.request.sampling, seq.generator, greedy_id)
            text, reason = self._text_of(seq, token_id, index)
        except Exception as exc:
            error = f"token {index} failed: {exc!r}"
            return [self._finish(seq, FinishReason.ERROR, error=error)]
        seq.generated_ids.append(token_id)
        events: list[EngineEvent] = [TokenEvent(seq.request_id, index, token_id, text)]
        if reason is not None:
            events.append(self._finish(seq, reason))
        return events

    def _text_of(self, seq: Sequence, token_id: int, index: int) -> tuple[str, FinishReason | None]:
        """The text token ``index`` adds, and why the sequence ends with it (or None)."""
        text, stopped = seq.stop_matcher.feed(seq.detokenizer.add(token_id))
        if stopped:
            return text, FinishReason.STOP
        is_eos = token_id in self.eos_token_ids and not seq.request.sampling.ignore_eos
        if not (is_eos or index + 1 == seq.request.max_new_tokens):
            return text, None
        tail, stopped = seq.stop_matcher.feed(seq.detokenizer.flush())
        if stopped:
            return text + tail, FinishReason.STOP
        text += tail + seq.stop_matcher.flush()
        return text, FinishReason.EOS if is_eos else FinishReason.LENGTH

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> FinishEvent:
        self.scheduler.finish(seq)
        with self._inbox_lock:
            self._live_ids.discard(seq.request_id)
        return FinishEvent(
            seq.request_id,
            reason,
            seq.num_prompt_tokens,
            len(seq.generated_ids),
            error,
            finished_at=time.time(),
        )

    def _record_step(self, started: float, *, decoded: bool, prefilled: bool) -> None:
        elapsed_ms = (time.perf_counter() - started) * 1000
        self._num_steps += 1
        self._last_step_ms = elapsed_ms
        if decoded and not prefilled:
            self._decode_ms.append(elapsed_ms)
        self._snapshot = self._take_snapshot()

    def _take_snapshot(self) -> EngineStatistics:
        return EngineStatistics(
            blocks_total=self.allocator.num_blocks,
            blocks_free=self.allocator.num_free,
            blocks_reserved=self.allocator.num_reserved,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            paused=self.scheduler.num_paused,
            admitted=self.scheduler.num_admitted,
            releases=self.allocator.num_releases,
            steps=self._num_steps,
            last_step_ms=self._last_step_ms,
            median_decode_step_ms=stats.median(self._decode_ms) if self._decode_ms else None,
        )

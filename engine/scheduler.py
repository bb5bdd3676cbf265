"""A step's phases: the wishes applied, deadlines, what the step carries, its records.

Theory of operation. Other threads only post wishes into the ``inbox.Inbox``; the
stepping thread applies them at the start of a step (``apply_inbox``): submits join
the waiting queue, cancels finish a waiting sequence (never admitted) or a running
one, pauses and resumes flip a flag. Then ``expire_deadlines`` finishes (DEADLINE)
each sequence past its ``ttft_deadline`` whose prefill has not begun: a deadline
never ends a sequence that has a token.

``schedule`` first has the ``residency.Residency`` (who holds blocks: ``waiting`` and
``running`` are its own) give out this step's blocks: each decode row's next one,
preempting by recompute while none is free, then, in a step that preempted nobody,
admission in arrival order (its docstring tells how). Then it takes the decode rows
(every running, unpaused sequence whose prefill is done) and then the prefills (fresh
prompts and recomputes) of this step, in arrival order (a higher band's first), within
the step's prefill budget: ``max_prefill_tokens``, or fewer with a step-time target
(``max_step_ms``), what the measured costs (``costs.StepCosts``) say fits beside this
step's decode rows (a step with nothing to decode keeps the whole budget: no stream
waits for it). The band yielding (``band_yield``): in a step carrying a higher band's
prompt, the lower bands' decode rows ride only as far as the measured costs keep the step
within a share over what the higher band's rows cost alone (in turn, at least one) and
their prompts wait; in a step of decode rows only, every row rides and the lower bands'
prompts get a share of the decode pass (never none), so a flood does not stretch an
interactive stream's gaps or its TTFT. A prompt that fits is prefilled whole; one that
does not waits for the next step, unless it is the first: then it is cut (chunked
prefill), its first chunk fills the budget (or the lower bands' share), and the rest
follows in the next steps, so a long prompt never stalls the running streams for longer
than the budget. Its first token comes with its last chunk. With a
step-time target a chunk counts its cached prefix too (``costs.cost_tokens``), so a
long prompt's late chunks, which attend over more positions, are cut shorter, and the
budget is planned within the target over the measured margin
(``costs.StepCosts.margin``): such a step's plan (``StepPlan.planned_ms``) is compared
with what it took.

``record_token`` is the per-sequence error boundary: it turns one sampled token
(or the exception its sampling raised) into events through the ``token_record.
TokenRecorder`` (text, stop, eos, length, log-probabilities); any exception there
finishes that sequence alone with ``ERROR``. ``finish`` is the only way out: the
residency takes the sequence out and releases its blocks (``Residency.remove``), as it
does a preempted one's, so every table is released exactly once. Pure Python: no torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .admission import DEFAULT_WATERMARK, ON_DEMAND, AdmissionPolicy
from .aging import band_of
from .band_yield import BandYield
from .block_allocator import BlockAllocator
from .costs import StepCosts, cost_tokens, tokens_within
from .inbox import Inbox, Op
from .logprobs import Outcome
from .prefix_cache import PrefixCache
from .residency import Residency
from .sequence import Chunk, Sequence, SequenceState
from .token_record import TokenRecorder
from .types import EngineEvent, FinishEvent, FinishReason, TokenEvent

# The least a step prefills while a prompt waits, however full the step target is with
# decoding: the prompt tokens that cost this share of the target (and at least
# MIN_PREFILL_TOKENS). Without it, a machine slower than the target starves prompts: a
# burstbench run (decode alone over a 299 ms target, 16 tokens a step) took 86 s to
# prefill a 1,000-token prompt; with it a step costs at most 1.5 targets.
MIN_PREFILL_SHARE = 0.5
MIN_PREFILL_TOKENS = 16


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step runs: prompt chunks to prefill and sequences to decode, disjoint."""

    prefill: list[Chunk]  # admitted, unpaused, prompt not all cached; arrival order
    decode: list[Sequence]  # running, unpaused, with a token to feed back
    planned_ms: float | None = None  # by the costs, with a step target, prefill and decode


class Scheduler:
    """A step's phases over one allocator: the inbox, deadlines, the step's plan and its
    prefill budget, tokens recorded, finishing; who holds blocks is its ``residency``.

    Args:
        allocator: the block pool.
        max_batch: most sequences running at once (batch slots).
        max_prefill_tokens: prompt tokens prefilled per step, at most.
        eos_token_ids: tokens that end a sequence (unless its request ignores eos).
        max_step_ms: a step-time target: the prefill budget is what ``costs`` says
            fits beside the step's decode pass (at least MIN_PREFILL_SHARE of it).
        costs: the measured step costs (the engine feeds them).
        admission: how many positions a table covers at admission (blocks on demand).
        watermark: share of the blocks an admission leaves free while others run.
        clock: what TTFT deadlines are read against (``time.monotonic`` seconds).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_batch: int,
        max_prefill_tokens: int,
        eos_token_ids: frozenset[int],
        max_step_ms: float | None = None,
        costs: StepCosts | None = None,
        admission: AdmissionPolicy = ON_DEMAND,
        watermark: float = DEFAULT_WATERMARK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError(
                f"max_batch ({max_batch}) and max_prefill_tokens "
                f"({max_prefill_tokens}) must be at least 1"
            )
        if max_step_ms is not None and not max_step_ms > 0:
            raise ValueError(f"max_step_ms must be positive, got {max_step_ms}")
        self.allocator = allocator
        self.prefix = PrefixCache(allocator)
        self.residency = Residency(allocator, self.prefix, max_batch=max_batch,
                                   max_prefill_tokens=max_prefill_tokens,
                                   admission=admission, watermark=watermark, clock=clock)
        self.clock = clock
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.max_step_ms = max_step_ms
        self.costs = costs or StepCosts()
        self.mixed_step = False  # the engine's: a step's prefill and decode share one pass
        self.recorder = TokenRecorder(eos_token_ids)  # token -> text, end, logprobs
        self.num_recomputed_tokens = 0  # positions prefilled again after a preemption
        # The residency's queue and set themselves (never rebound): who waits, who runs.
        self.waiting: deque[Sequence] = self.residency.waiting
        self.running: dict[str, Sequence] = self.residency.running  # in admission order
        self.inbox = Inbox()  # the wishes of other threads: Engine.submit, cancel, ...
        self._resumed: list[Sequence] = []  # replayed by apply_inbox: see take_resumed
        self._plans = 0  # plans made (lower rows ride yielding steps in turn: band_yield)

    def has_work(self) -> bool:
        """Whether a step would do anything. For the step's caller, between steps."""
        if not self.inbox.is_empty():
            return True
        if any(_expired(s, self.clock()) for s in (*self.waiting, *self.running.values())):
            return True  # the next step finishes it (expire_deadlines): once, no spin
        if (self.waiting and len(self.running) < self.max_batch
                and self.residency.fits(self.waiting[0])):
            return True
        if self.running and self.residency.priority_victim_now() is not None:
            return True  # a higher band waits for a preemption
        return any(not s.is_paused for s in self.running.values())

    # -- the step's phases: the stepping thread only ------------------------------

    def apply_inbox(self) -> list[EngineEvent]:
        """Apply the posted wishes in order; return the finishes of cancels."""
        events: list[EngineEvent] = []
        active: set[str] | None = None  # the tenants with work (fair shares), once a step
        for wish in self.inbox.take():
            if isinstance(wish, Sequence):
                wish.submitted_at = self.clock()
                active = self.active_tenants() if active is None else active
                self.residency.fair.arrive(wish.request.tenant, active)
                active.add(wish.request.tenant)
                self.residency.enqueue(wish)
                if wish.generated_ids:  # a stream rebuilt elsewhere (Engine.submit)
                    events += self._replay(wish)
                continue
            op, request_id = wish
            seq = self.find(request_id)
            if seq is None:
                continue  # unknown or already finished: nothing to do
            if op is Op.CANCEL:
                events.append(self.finish(seq, FinishReason.CANCELLED))
            else:
                seq.is_paused = op is Op.PAUSE
        return events

    def take_resumed(self) -> list[Sequence]:
        """The sequences submitted with tokens that the last ``apply_inbox`` replayed
        (still live): their generators are to be advanced. Each is given once."""
        resumed, self._resumed = self._resumed, []
        return [s for s in resumed if s.state is not SequenceState.FINISHED]

    def _replay(self, seq: Sequence) -> list[EngineEvent]:
        """Bring a rebuilt sequence's detokenizer and stop matcher to where they were
        after its generated tokens, silently (their events went out where they were
        made); a finish if those tokens already end it (the finish was lost)."""
        self._resumed.append(seq)
        ended = self.recorder.replay(seq)
        if ended is None:
            return []
        reason, error = ended
        return [self.finish(seq, reason, error=error)]

    def expire_deadlines(self, now: float) -> list[EngineEvent]:
        """Finish with DEADLINE every sequence whose ``ttft_deadline`` (time.monotonic()
        seconds) is before ``now`` and whose prefill has not begun: waiting ones (they
        hold no blocks) and admitted ones no pass has touched (their blocks go back
        through ``finish``). A sequence that has a token, or a cached chunk, runs on."""
        expired = [s for s in (*self.waiting, *self.running.values()) if _expired(s, now)]
        return [self.finish(s, FinishReason.DEADLINE) for s in expired]

    def schedule(self) -> StepPlan:
        """Admit what fits, then choose this step's decode rows and prompt chunks."""
        self.residency.fair.weigh(self.costs, self.num_decoding)  # fair shares' weights
        self.residency.grant()  # decode rows' blocks (preempting), then admission
        self._plans += 1
        live = [s for s in self.running.values() if not s.is_paused]
        decode = [s for s in live if not s.needs_prefill]
        budget = self.prefill_budget(len(decode))
        timed = self.max_step_ms is not None  # then a late chunk's prefix counts (costs)
        # A higher band's prompt first (``engine.priority``: the band it runs at, so one
        # admitted by aging is not starved of prefill); admission order within a band.
        prompts = sorted((s for s in live if s.needs_prefill), key=band_of)
        top = min((band_of(s) for s in live), default=None)
        if top is None or all(band_of(s) <= top for s in live):
            prefill, _ = self._chunks(prompts, budget, timed)
        else:  # the band yielding (``engine.band_yield``): the higher band's rows first
            rule = BandYield(self.costs, self.mixed_step, self.max_prefill_tokens)
            prefill, used = self._chunks([s for s in prompts if band_of(s) <= top], budget,
                                         timed)
            if prefill:  # a higher band's first token waits for this step: rows yield
                higher = sum(band_of(s) <= top for s in decode)
                riding = {s.request_id for s in rule.decode_rows(
                    [s for s in decode if band_of(s) > top], higher, used,
                    rule.limit_ms(higher, used), lambda s: self._plans - s.last_decode_plan)}
                decode = [s for s in decode if band_of(s) <= top or s.request_id in riding]
                for seq in decode:
                    seq.last_decode_plan = self._plans  # rode in a yielding step
            else:  # decode rows only: lower prompts within a share of the decode pass
                prefill, _ = self._chunks([s for s in prompts if band_of(s) > top],
                                          rule.prompt_budget(len(decode), budget), timed)
        planned = None
        if timed and prefill and decode:
            cost = sum(cost_tokens(c.end - c.start, c.start) for c in prefill)
            planned = self.costs.step_ms(len(decode), cost, self.mixed_step)
        return StepPlan(prefill, decode, planned)

    @staticmethod
    def _chunks(prompts: list[Sequence], budget: int, timed: bool) -> tuple[list[Chunk], int]:
        """Chunks of ``prompts`` (in order) within ``budget`` prompt tokens (cost tokens
        when ``timed``), and what they count. A prompt that fits is prefilled whole; the
        first that does not waits for the next step, unless it is the first: then it is
        cut to the budget (chunked prefill)."""
        prefill: list[Chunk] = []
        used = 0
        for seq in prompts:
            left = seq.num_to_cache
            cost = cost_tokens(left, seq.num_prefilled) if timed else left
            if used + cost <= budget:
                prefill.append(Chunk(seq, seq.num_prefilled, seq.prefill_end))
                used += cost
                continue
            if not prefill and budget > 0:  # the first prompt: cut it to the budget
                take = max(tokens_within(budget, seq.num_prefilled) if timed else budget, 1)
                prefill.append(Chunk(seq, seq.num_prefilled, seq.num_prefilled + take))
                used = budget
            break
        return prefill, used

    def prefill_budget(self, decode_rows: int) -> int:
        """Prompt tokens a step with ``decode_rows`` decode rows may prefill.

        With no decode row, nobody waits for the step: the whole ``max_prefill_tokens``.
        With a step target, what fits the target over the costs' margin.
        """
        if self.max_step_ms is None or decode_rows == 0:
            return self.max_prefill_tokens
        target = self.max_step_ms / self.costs.margin()
        within = self.costs.prefill_tokens_within(target, decode_rows, self.mixed_step)
        least = self.costs.prefill_tokens_within(self.max_step_ms * MIN_PREFILL_SHARE, 0)
        if within is None or least is None:  # nothing measured yet
            return self.max_prefill_tokens
        return min(self.max_prefill_tokens, max(within, least, MIN_PREFILL_TOKENS))

    def record_chunk(self, chunk: Chunk, token: Outcome | None) -> list[EngineEvent]:
        """A prefilled chunk: its positions are cached; a fresh prompt's last chunk
        brings the first token (or the exception that sampling it raised)."""
        chunk.seq.num_prefilled = chunk.end
        self.prefix.commit(chunk.seq, chunk.end)  # prefix cache: its full blocks
        self.num_recomputed_tokens += max(min(chunk.end, chunk.seq.num_lost) - chunk.start, 0)
        return [] if token is None else self.record_token(chunk.seq, token)

    def record_token(self, seq: Sequence, token: Outcome) -> list[EngineEvent]:
        """The events of one sequence's new token (or of the exception that sampling it raised).

        The per-sequence error boundary: an exception from sampling, the detokenizer or
        the stop matcher finishes this sequence alone (ERROR, blocks released once), and
        the token it was making is not counted.
        """
        index = len(seq.generated_ids)
        try:
            read = self.recorder.read(seq, token, index)
        except Exception as exc:
            return [self.finish(seq, FinishReason.ERROR, error=f"token {index} failed: {exc!r}")]
        seq.generated_ids.append(read.token_id)
        if index:  # a decode row's token (the first is its prompt's, charged at admission)
            self.residency.fair.charge(seq.request.tenant, decode_tokens=1)
        self.prefix.commit(seq, seq.num_cached)  # prefix cache: its full blocks
        events: list[EngineEvent] = [TokenEvent(seq.request_id, index, read.token_id, read.text,
                                                read.logprobs)]
        if read.reason is not None:
            events.append(self.finish(seq, read.reason))
        return events

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> FinishEvent:
        """Take a sequence out for good, releasing its blocks if it held any."""
        self.residency.remove(seq)
        seq.state = SequenceState.FINISHED
        self.inbox.retire(seq.request_id)
        stop = seq.stop_matcher.matched if reason is FinishReason.STOP else None
        return FinishEvent(seq.request_id, reason, seq.num_prompt_tokens, len(seq.generated_ids),
                           error, stop, seq.num_cached_prompt_tokens or 0)

    # -- helpers ---------------------------------------------------------------------

    def find(self, request_id: str) -> Sequence | None:
        if request_id in self.running:
            return self.running[request_id]
        return next((s for s in self.waiting if s.request_id == request_id), None)

    def active_tenants(self) -> set[str]:
        """The tenants with a sequence waiting or running (fair shares)."""
        return {s.request.tenant for s in (*self.waiting, *self.running.values())}

    def prompt_tokens_to_prefill(self) -> int:
        """Positions to prefill (prompts, recomputes), of every waiting and admitted one."""
        return sum(s.num_to_cache for s in self.running.values()) + sum(
            s.num_to_cache for s in self.waiting)

    @property
    def num_decoding(self) -> int:
        return sum(not s.is_paused and not s.needs_prefill for s in self.running.values())

    @property
    def num_blocks_filled(self) -> int:
        """Blocks holding at least one cached position of a running sequence."""
        needed = self.allocator.blocks_needed
        return sum(needed(s.num_prefilled if s.needs_prefill else s.num_cached)
                   for s in self.running.values())

    @property
    def num_paused(self) -> int:
        return sum(s.is_paused for s in self.running.values())

    @property
    def admission(self) -> AdmissionPolicy:
        return self.residency.admission

    @property
    def num_admitted(self) -> int:
        return self.residency.num_admitted

    @property
    def num_preemptions(self) -> int:
        return self.residency.num_preemptions


def _expired(seq: Sequence, now: float) -> bool:
    """Whether ``seq`` is past its TTFT deadline with no token and no position written
    by a pass: the ones it found cached at admission (``num_prefilled`` starts at its
    table's hit) are not a begun prefill, or a cache hit would outlive its deadline."""
    deadline = seq.request.ttft_deadline
    if deadline is None or not deadline < now or seq.generated_ids:
        return False
    found = seq.block_table.num_hit_tokens if seq.block_table is not None else 0
    return seq.num_prefilled <= found

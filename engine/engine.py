"""The step-driven engine: continuous batching over a paged KV cache.

Theory of operation. The rest of the program talks to the engine through four
thread-safe methods, ``submit``, ``cancel``, ``pause`` and ``resume``, which
only record a wish in the scheduler's inbox. Everything that changes a sequence
or the cache happens inside ``step()``, which one caller runs repeatedly: one round
(``step_round.StepRound``: apply the inbox, schedule, prefill and decode, in ONE
forward pass with ``mixed_step``, then return the events; its docstring says how,
and what a failure inside it ends).

Who does what: the ``Scheduler`` (pure Python) owns the inbox, admission (by an
``AdmissionPolicy``), the budget and every finish, over the ``BlockAllocator`` (pure
Python); the runner (``ModelRunner``, the only torch) owns the cache tensors, builds
the batches, runs the forward passes and samples; ``StepPasses`` runs a step's passes
through it and contains their failures; text (detokenizer, stop strings) runs in the
scheduler's per-sequence error boundary; ``StepTiming`` clocks the steps,
``TtftEstimator`` turns costs and the queue into a first-token estimate and
``step_round``'s ``boundary_statistics`` builds what ``statistics()`` returns. This
module only wires them, so it imports no torch: tests drive it with a scripted runner.

A sequence is therefore never removed while its tensors are in use, and its
blocks are released in one place (``BlockAllocator.release``, which raises on
a second release). ``statistics()`` is a snapshot taken at the last step
boundary, so reading it never waits for a step.

Prompts are encoded with ``tokenize`` (any thread, its own copy of the
tokenizer: see ``text.PromptEncoder``), or in ``submit``, which turns a request into
a sequence in the caller's thread (``intake.Intake``: checks, prompt ids, a
constraint's compiled matcher); detokenizing happens only in the stepping thread,
so no fast tokenizer is used by two threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from .admission import DEFAULT_WATERMARK, ON_DEMAND, AdmissionPolicy
from .block_allocator import BlockAllocator
from .constraint_costs import ConstraintCosts
from .costs import StepCosts, calibrate
from .inbox import Op
from .intake import Intake
from .logprobs import TokenTexts
from .model_side import ModelSource, Runner
from .scheduler import Scheduler
from .step_round import PrefillCallback, StepRound
from .step_timing import StepTiming
from .ttft import TtftEstimator
from .types import Constraint, EngineEvent, EngineStatistics, GenerationRequest

# Prompt tokens prefilled in one step. A prefill costs time roughly in proportion to
# its tokens, and every running stream waits for the whole step: a budget of about six
# of the experiments' prompts (34-45 tokens) per step bounds that wait, while a burst of
# 32 arrivals is still admitted within about six steps.
DEFAULT_MAX_PREFILL_TOKENS = 256
# The cache's share of the device's available memory when no num_blocks is given: on a
# GPU the model is loaded first, so this is of what it left; on a CPU of the
# machine's available memory, shared with everything else it runs.
DEFAULT_CACHE_MEMORY = 0.1


class Engine:
    """A language model serving many sequences, one round per ``step()``.

    Args:
        loaded: the model and tokenizer (see ``engine.model.load_model``).
        max_batch: most sequences running at once (batch slots).
        num_blocks: KV-cache blocks, allocated once. None: as many as ``cache_memory``
            holds (``kv_cache.blocks_for_memory``: the model's bytes per position),
            at most what ``max_batch`` sequences of the model's context can fill.
        block_size: positions per block.
        cache_memory: the cache's memory when ``num_blocks`` is None: a float is a
            share of the device's available memory (after the model is loaded), an
            int a number of bytes.
        admission: how many positions a sequence's table covers when it is admitted:
            by default ``OnDemandAdmission`` (blocks as sequences write, preemption by
            recompute when they run out). See ``admission`` and ``residency``.
        watermark: share of the blocks an on-demand admission leaves free while
            others run.
        eos_token_ids: override the model's end-of-sequence ids.
        max_prefill_tokens: prompt tokens prefilled per step, at most; a longer prompt
            is prefilled in chunks over several steps.
        max_step_ms: a step-time target: each step prefills only the prompt tokens
            that measured costs say fit beside its decode pass (``calibrate`` runs
            at once). None: ``max_prefill_tokens`` alone.
        mixed_step: run a step's prefill and decode rows in one forward pass; else two.
        prefix_cache: share the full blocks of prompts that begin alike (``prefix_cache``).
        runner: the model side; by default a ``ModelRunner`` over ``loaded.model``. A
            step's prompt chunks go to one ``prefill`` call (one packed pass); a runner
            that runs them one pass each gives the exact mode (``tools/serial_prefill``).
        clock: what TTFT deadlines are read against (``GenerationRequest.ttft_deadline``
            is in its seconds): ``time.monotonic``; a test may give its own.
        constraint_costs: the bounds on what a constraint may cost, at compile and in
            the step (``constraint_costs``; None: the defaults).
    """

    def __init__(
        self,
        loaded: ModelSource,
        *,
        max_batch: int = 32,
        num_blocks: int | None = None,
        block_size: int = 16,
        cache_memory: float | int = DEFAULT_CACHE_MEMORY,
        admission: AdmissionPolicy = ON_DEMAND,
        watermark: float = DEFAULT_WATERMARK,
        eos_token_ids: frozenset[int] | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        max_step_ms: float | None = None,
        mixed_step: bool = True,
        prefix_cache: bool = False,
        runner: Runner | None = None,
        clock: Callable[[], float] = time.monotonic,
        constraint_costs: ConstraintCosts | None = None,
    ) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer  # the stepping thread's: detokenizers use it
        if num_blocks is None:
            if runner is not None:
                raise ValueError("num_blocks is required with a given runner")
            from .kv_cache import blocks_for_memory  # the torch side

            num_blocks = blocks_for_memory(
                loaded, block_size, cache_memory,  # type: ignore[arg-type]
                max_positions=max_batch * loaded.max_context,
            )
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_cache=prefix_cache)
        self.scheduler = Scheduler(
            self.allocator,
            max_batch=max_batch,
            max_prefill_tokens=max_prefill_tokens,
            eos_token_ids=loaded.eos_token_ids if eos_token_ids is None else eos_token_ids,
            max_step_ms=max_step_ms,
            admission=admission,
            watermark=watermark,
            clock=clock,
        )
        self.costs: StepCosts = self.scheduler.costs
        self.scheduler.recorder.token_text = TokenTexts(loaded.tokenizer)  # logprobs' texts
        self.mixed_step = self.scheduler.mixed_step = mixed_step
        if runner is None:
            from .model_runner import ModelRunner  # the torch side, only when it is needed

            runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size,  # type: ignore[arg-type]
                                 mask_budget_ms=(constraint_costs or ConstraintCosts()).mask_ms)
        self.runner = runner
        self._intake = Intake(loaded, runner, min(loaded.max_context, num_blocks * block_size),
                              self.scheduler.recorder.eos_token_ids, constraint_costs)
        self.vocab_size = self._intake.vocab_size  # token ids given to submit are below it
        # Prompt and new tokens together, at most (the model's context, or the whole cache
        # if smaller): what check_budget refuses beyond, for servers to fit limits to.
        self.max_positions = self._intake.max_positions
        self.timing = StepTiming()
        self.start_phases_s: dict[str, float] = {}  # load_engine's (engine.startup)
        self._ttft = TtftEstimator(self.scheduler, self.timing)
        self._round = StepRound(self.scheduler, runner, self.timing, self._ttft)
        if max_step_ms is not None:
            self.calibrate()

    @property
    def max_prefill_tokens(self) -> int:
        return self.scheduler.max_prefill_tokens

    @property
    def num_mixed_steps(self) -> int:
        """Steps whose prefill and decode ran in one forward pass."""
        return self._round.passes.num_mixed

    # -- the thread-safe entry points: they only record a wish ---------------

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids, for ``GenerationRequest.prompt_token_ids``.

        Thread-safe, and never shares a tokenizer with the stepping thread; it blocks
        (a 32k-character prompt takes tens of milliseconds), so an event loop runs it
        in a worker thread.
        """
        return self._intake.encoder.encode(prompt)

    def tokenize_if_free(self, prompt: str) -> list[int] | None:
        """``tokenize(prompt)`` if the encoder is free now, else None without waiting:
        for an event loop to encode a short prompt itself (tens of microseconds, less
        than a worker thread's round trip) without ever waiting for a long one."""
        return self._intake.encoder.encode_if_free(prompt)

    def render_chat(
        self, messages: Seq[Mapping[str, str]], add_generation_prompt: bool = True,
        tools: Seq[Mapping[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """Chat messages (``{"role", "content"}``) rendered by the tokenizer's own chat
        template: the prompt text and its token ids, for ``GenerationRequest.prompt`` and
        ``prompt_token_ids``; ``tools`` (function definitions) go to a template that
        renders its own (``apply_chat_template(tools=...)``). Thread-safe and blocking,
        like ``tokenize``.

        Raises:
            ChatTemplateError: the model has no chat template, or it refused the messages.
        """
        return self._intake.render_chat(messages, add_generation_prompt, tools)

    def chat_template_uses(self, name: str) -> bool:
        """Whether the chat template names ``name`` (a variable such as
        ``reasoning_effort``): the app accepts such a request field, and ignores it,
        only where the template has no use for it. Any thread; no tokenizer call."""
        template = getattr(self._intake.tokenizer, "chat_template", None)
        return bool(template) and name in str(template)

    def submit(self, request: GenerationRequest, resume_from: Seq[int] = ()) -> int:
        """Validate and queue a request; return its prompt's token count.

        The prompt is encoded here unless ``request.prompt_token_ids`` holds its ids.

        ``resume_from``: the tokens this request already generated (a stream rebuilt on
        another replica after its writer died). It continues exactly as the
        uninterrupted run would: its prefill caches the prompt and these tokens but the
        last (as a preempted sequence's recompute: nothing sampled), the step that
        applies the submit replays them through its detokenizer and stop matcher with no
        event (text and stop strings across the cut come out the same) and advances its
        generator by the draws they took (``Runner.advance_generator``); its token
        events go on from index ``len(resume_from)``, and ``max_new_tokens`` counts
        them. If they already end it (a stop string, eos, the length), that step gives
        only its FinishEvent. A sampled request needs its ``seed`` for this. A
        constrained request's matcher is compiled here if ``compile_constraint`` did
        not, and replays those tokens with them.

        Raises:
            EmptyPrompt, InvalidMaxNewTokens, InvalidSampling, PromptTooLong,
            DuplicateRequestId, InvalidTokenId (a given id outside the vocabulary),
            InvalidConstraint: nothing was queued.
        """
        seq = self._intake.sequence(request, resume_from)
        self.scheduler.inbox.post_submit(seq)
        return seq.num_prompt_tokens

    def compile_constraint(self, constraint: Constraint, namespace: bytes = b"",
                           owner: Hashable = None) -> None:
        """Compile a request's constraint now, so that its ``submit`` finds it compiled
        (``constraints``: a cache keyed by the request's ``cache_namespace`` and the
        constraint, bounded by bytes, ``owner``'s share of it at most; None: the
        namespace's). Thread-safe and blocking (milliseconds, one compile at a time;
        the first constraint also builds the library's view of the tokenizer,
        seconds): a server runs it in a worker thread while validating.

        Raises:
            InvalidConstraint: the library refuses it, or it costs too much
                (``constraint_costs``); the message says why. Nothing is kept.
        """
        self._intake.compile(constraint, namespace, owner)

    def constraint_cached(self, constraint: Constraint, namespace: bytes = b"") -> bool:
        """Whether ``namespace`` has ``constraint`` compiled. Never waits: an event loop
        may ask, and compile in a thread only when not."""
        return self._intake.constraints.cached(constraint, namespace)

    def check_budget(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise PromptTooLong if the request can never fit the cache or the model."""
        self._intake.check_budget(prompt_tokens, max_new_tokens)

    def cancel(self, request_id: str) -> None:
        """Ask for a request to end at the next step boundary (idempotent)."""
        self.scheduler.inbox.post(Op.CANCEL, request_id)

    def pause(self, request_id: str) -> None:
        """Leave a running request out of decoding; it keeps its blocks and slot."""
        self.scheduler.inbox.post(Op.PAUSE, request_id)

    def resume(self, request_id: str) -> None:
        self.scheduler.inbox.post(Op.RESUME, request_id)

    def has_work(self) -> bool:
        """Whether a step would do anything. For the step's caller, between steps."""
        return self.scheduler.has_work()

    def statistics(self) -> EngineStatistics:
        """The state at the last step boundary."""
        return self._round.statistics

    def estimate_ttft_ms(self, prompt_tokens: int, prompt_ids: Seq[int] = (),
                         cache_namespace: bytes = b"", priority: int = 0) -> float | None:
        """How long until a request of ``prompt_tokens`` submitted now gets its first
        token, in ms, by the measured step costs; None before any was measured
        (``ttft.TtftEstimator``), less its ids' cached prefix in ``cache_namespace``
        (the request's: another namespace's blocks are never counted), with its band
        ``priority``'s place in view (lower bands behind it, preemptible). Thread-safe:
        it reads the last step boundary's state.
        """
        cached = self.scheduler.prefix.cached_tokens(prompt_ids, self._ttft.ahead,
                                                     cache_namespace)
        return self._ttft.estimate_ms(prompt_tokens - cached, priority)

    # -- the step: only its one caller runs it --------------------------------

    def step(self, on_prefill: PrefillCallback | None = None) -> list[EngineEvent]:
        """Run one round (see the module docstring) and return its events.

        With ``on_prefill``, the finishes of cancels applied at the start of the step,
        then the prefills' events (a mixed step's: every event of its one pass), are
        handed to it as soon as they are made; they are not repeated in the return
        value.

        Raises:
            StepReentered: another thread is inside step().
            Exception: whatever ``on_prefill`` raised. Every event made in this step
                was handed to ``on_prefill`` by then; no other event was made, and the
                prefills and decode not run yet run at the next step.
        """
        return self._round.run(on_prefill)

    def calibrate(self) -> None:
        """Time a few dummy forward passes before any request (see ``costs.calibrate``)."""
        assert not self.scheduler.running, "calibrate before the first request"
        cached = self.allocator.num_blocks * self.allocator.block_size
        calibrate(self.runner, self.costs, num_blocks=self.allocator.num_blocks,
                  positions=min(self.loaded.max_context, cached),
                  max_batch=self.scheduler.max_batch, mixed=self.mixed_step)

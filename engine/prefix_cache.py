"""Prefix caching's side of a sequence: block identities, what admission may share, commits.

A full block's identity is a digest chained over the tokens before it: block ``i`` of
a token list is ``sha256(identity(i - 1) + tokens[i * B:(i + 1) * B])`` (B the block
size), as vLLM's automatic prefix caching hashes a block with its parent's hash. The
first block's parent is the request's *root*: ``ROOT`` for a request with no
``cache_namespace``, else ``root_of(namespace)``, a digest of ``ROOT`` and the
namespace (vLLM's ``cache_salt``, hashed into the first block). Two sequences whose
tokens agree up to a block's end, under the same namespace, have the same identity for
it, and the same keys and values in it (the model, its dtype and device are one per
engine); under two namespaces they share no block, since every identity descends from
the root. The engine gives namespaces no meaning: the app derives one per API key
(``docs/security.md``). A SHA-256 is used, not Python's ``hash``, so that two different
prefixes never meet in practice (a collision would hand a sequence another's cache).

A sequence's identities are memoized on it (``Sequence.block_digests``) and only
extended: its tokens (prompt, then generated) and its namespace never change, and a
recompute's ``prefill_ids`` are a prefix of them. The scheduler holds one
``PrefixCache`` over its allocator and calls:

* ``admission_digests(seq)``: the identities admission may share: the full blocks of
  ``prefill_ids`` but never its last position, so that at least one position is
  computed (a fresh prompt's last one gives the logits of its first token; a
  recompute's keeps the table covering what decode writes next);
* ``fits`` and ``admit``: the allocator's reservation, sharing those blocks;
* ``defer``: admission waits while the admitted still have a step's prefill to do;
* ``in_flight`` and ``waits_for``: admission also waits while the first block a
  sequence would compute is one that a running prefill is computing: it shares that
  block once committed, instead of computing it again in the same step;
* ``commit(seq, num_written)``: after a pass wrote positions, offer the newly full
  blocks to the cache;
* ``expected_hit_tokens`` and ``cached_tokens``: what a waiting sequence, or a prompt
  not submitted yet (in its namespace), would find cached now (the TTFT estimate
  counts only the rest).

Every method is a no-op (no digest computed) when the allocator's ``prefix_cache`` is
off. Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet
from typing import Any

from .block_allocator import BlockAllocator, BlockTable
from .sequence import Sequence

ROOT = b"streamscope-prefix-cache-v1"
# A namespace is an opaque digest the caller derived (the app's is 32 bytes); bounded so
# that a request cannot carry an arbitrary blob into every block identity it makes.
MAX_NAMESPACE_BYTES = 64


def root_of(namespace: bytes) -> bytes:
    """The first block's parent under ``namespace`` (``ROOT`` for none)."""
    if not namespace:
        return ROOT
    return hashlib.sha256(ROOT + b"\x00namespace\x00" + namespace).digest()


def block_digests(tokens: Seq[int], block_size: int, known: list[bytes] | None = None,
                  num_blocks: int | None = None, root: bytes = ROOT) -> list[bytes]:
    """The identities of the full blocks of ``tokens`` (the first ``num_blocks`` of
    them) chained from ``root``, extending ``known`` (the identities already computed,
    for the same tokens and root) in place."""
    digests = [] if known is None else known
    full = len(tokens) // block_size
    want = full if num_blocks is None else min(num_blocks, full)
    while len(digests) < want:
        index = len(digests)
        parent = digests[-1] if digests else root
        block = array("q", tokens[index * block_size:(index + 1) * block_size])
        digests.append(hashlib.sha256(parent + block.tobytes()).digest())
    return digests


def _digests(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """The first ``num_blocks`` identities of ``seq``'s tokens (memoized on it)."""
    known = seq.block_digests
    if len(known) < num_blocks:
        end = num_blocks * block_size
        prompt = seq.prompt_ids
        tokens = prompt[:end] if end <= len(prompt) else prompt + seq.generated_ids
        root = known[-1] if known else root_of(seq.request.cache_namespace)
        block_digests(tokens, block_size, known, num_blocks, root)
    return known[:num_blocks]


class PrefixCache:
    """The prefix cache over one allocator: what the scheduler asks of it (see above)."""

    __slots__ = ("allocator",)

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator

    @property
    def on(self) -> bool:
        return self.allocator.prefix_cache

    def admission_digests(self, seq: Sequence) -> list[bytes]:
        """The identities of the blocks ``seq``'s admission may find cached."""
        if not self.on:
            return []
        size = self.allocator.block_size
        return _digests(seq, size, (seq.prefill_end - 1) // size)

    def fits(self, seq: Sequence, positions: int, headroom: int) -> bool:
        """Whether ``seq`` can be admitted with a table of ``positions``, sharing what
        is cached, leaving ``headroom`` blocks free (``BlockAllocator.can_reserve``)."""
        return self.allocator.can_reserve(positions, headroom, self.admission_digests(seq))

    def admit(self, seq: Sequence, positions: int) -> BlockTable:
        """``seq``'s new table of ``positions``, its cached prefix shared: those
        positions count as prefilled, so its prefill starts after them (the caller
        checked ``fits``)."""
        table = self.allocator.reserve(seq.request_id, positions,
                                       self.admission_digests(seq),
                                       query_tokens=seq.prefill_end)
        seq.num_prefilled = table.num_hit_tokens
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(table.num_hit_tokens, seq.num_prompt_tokens)
        return table

    def defer(self, running: Mapping[str, Sequence], budget: int) -> bool:
        """Whether admission waits a step: the admitted sequences still have a step's
        ``budget`` of positions to prefill, so one admitted now would not be prefilled
        this step anyway, and next step it may find cached what this step commits (a
        burst of prompts with one system prompt computes it once, not once each)."""
        return self.on and sum(s.num_to_cache for s in running.values()) >= budget

    def in_flight(self, running: Iterable[Sequence]) -> set[bytes]:
        """The identities of the full blocks that running sequences' prefills are
        computing and have not committed yet (paused ones excluded: they make no
        progress). Called every step: with the cache off, no walk over them."""
        pending: set[bytes] = set()
        if not self.on:
            return pending
        for seq in running:
            table = seq.block_table
            if not seq.is_paused and seq.needs_prefill and table is not None:
                pending.update(self.prefill_digests(seq)[table.num_committed:])
        return pending

    def prefill_digests(self, seq: Sequence) -> list[bytes]:
        """The identities of the full blocks ``seq``'s prefill writes (none if off)."""
        if not self.on:
            return []
        size = self.allocator.block_size
        return _digests(seq, size, seq.prefill_end // size)

    def waits_for(self, seq: Sequence, pending: AbstractSet[bytes]) -> bool:
        """Whether admitting ``seq`` now would compute a block that another sequence is
        computing (its first uncached block is in ``pending``): then it waits, and is
        admitted when that block is committed, sharing it. Without this, identical
        prompts admitted in one step (a burst with one system prompt) would each
        compute it."""
        if not pending:
            return False
        digests = self.admission_digests(seq)
        hits = len(self.allocator.match(digests))
        return hits < len(digests) and digests[hits] in pending

    def commit(self, seq: Sequence, num_written: int) -> None:
        """``seq``'s first ``num_written`` positions are in its blocks: offer the full
        ones."""
        table = seq.block_table
        if not self.on or table is None:
            return
        full = num_written // self.allocator.block_size
        if full > table.num_committed:
            self.allocator.commit(table, _digests(seq, self.allocator.block_size, full),
                                  num_written)

    def expected_hit_tokens(self, seq: Sequence,
                            pending: AbstractSet[bytes] = frozenset()) -> int:
        """Positions of a waiting ``seq``'s prefill that admission would find cached
        now, or, with ``pending`` (``in_flight``), once what is being computed is
        committed: a sequence waiting for those blocks computes none of them."""
        if not self.on:
            return 0
        return self._hits(self.admission_digests(seq), pending) * self.allocator.block_size

    def cached_tokens(self, prompt_ids: Seq[int], pending: AbstractSet[bytes] = frozenset(),
                      namespace: bytes = b"") -> int:
        """Positions of a new prompt of ``namespace`` that are cached now (never its
        last one), or will be once ``pending`` (what the sequences ahead compute) is:
        another namespace's blocks never count. Any thread: it only reads the
        committed identities, an estimate if a step changes them."""
        if not self.on or not prompt_ids:
            return 0
        size = self.allocator.block_size
        digests = block_digests(prompt_ids, size, num_blocks=(len(prompt_ids) - 1) // size,
                                root=root_of(namespace))
        return self._hits(digests, pending) * size

    def _hits(self, digests: list[bytes], pending: AbstractSet[bytes]) -> int:
        """How many leading ``digests`` are committed, or in ``pending`` after those."""
        hits = len(self.allocator.match(digests))
        while hits < len(digests) and digests[hits] in pending:
            hits += 1
        return hits

    def statistics(self) -> dict[str, Any]:
        """The prefix cache's counters, as ``EngineStatistics`` names them."""
        allocator = self.allocator
        return {
            "prefix_cache_queries": allocator.num_query_tokens,
            "prefix_cache_hits": allocator.num_hit_tokens,
            "blocks_cached": allocator.num_cached,
            "blocks_evicted": allocator.num_evictions,
            "blocks_shared": allocator.num_shared,
        }


__all__ = [
    "MAX_NAMESPACE_BYTES",
    "ROOT",
    "PrefixCache",
    "block_digests",
    "root_of",
]

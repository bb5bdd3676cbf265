"""The compiled constraints kept: per tenant, bounded by bytes, each owner within a share.

Why this shape: a template's memory varies by orders of magnitude (an ordinary schema:
tens of kB; a nested-count regex under the library's default limits: about 160 MB), so
a bound by count (128 before) bounded nothing; and one cache shared by every key let one
key evict the others' schemas, and let it tell by timing whether another key had used a
schema (a hit answers in microseconds, a compile in milliseconds).

* Keyed by (namespace, constraint): the namespace is the request's prefix-cache
  namespace (the app's: its API key and ``cache_salt``), so a key finds only what it
  compiled itself.
* Bounded by bytes (``constraint_costs.template_bytes``'s estimate): ``cache_bytes`` in
  all, ``share_bytes`` per owner (the API key, across its salts). A template that
  would take its owner over its share evicts that owner's own least recently used
  first; over the total, the owner holding the most gives way (its least recently
  used). An owner within its share is never evicted by one that holds more.

Plain Python, not thread-safe: ``Constraints`` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from .types import Constraint

Key = tuple[bytes, Constraint]


@dataclass(slots=True)
class _Entry:
    template: Any
    owner: Hashable
    size: int


class TemplateCache:
    """Compiled templates by (namespace, constraint), least recently used first.

    Args:
        total_bytes: the most bytes kept in all.
        share_bytes: the most bytes one owner keeps.
    """

    def __init__(self, total_bytes: int, share_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.share_bytes = min(share_bytes, total_bytes)
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._by_owner: dict[Hashable, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> Any:
        """The template, now the most recently used; None if not kept."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.template

    def owner_bytes(self, owner: Hashable) -> int:
        return self._by_owner.get(owner, 0)

    def put(self, key: Key, template: Any, owner: Hashable, size: int) -> None:
        """Keep ``template`` (``size`` bytes), evicting as the module says; one bigger
        than a share is not kept (the caller refuses those before)."""
        if key in self._entries:
            self._drop(key)
        if size > self.share_bytes:
            return
        while self.owner_bytes(owner) + size > self.share_bytes:
            self._drop(self._oldest_of(owner))
        while self.bytes + size > self.total_bytes:
            self._drop(self._oldest_of(self._largest_owner(owner)))
        self._entries[key] = _Entry(template, owner, size)
        self._by_owner[owner] = self.owner_bytes(owner) + size
        self.bytes += size

    def _largest_owner(self, newcomer: Hashable) -> Hashable:
        """The owner holding the most bytes (the newcomer itself on a tie)."""
        most = max(self._by_owner.values())
        if self.owner_bytes(newcomer) == most:
            return newcomer
        return next(owner for owner, held in self._by_owner.items() if held == most)

    def _oldest_of(self, owner: Hashable) -> Key:
        return next(key for key, entry in self._entries.items() if entry.owner == owner)

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.size
        left = self._by_owner[entry.owner] - entry.size
        if left:
            self._by_owner[entry.owner] = left
        else:
            del self._by_owner[entry.owner]

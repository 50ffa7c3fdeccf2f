"""Per-sequence page tables over one page pool, with the prefix cache and integrity tags beside them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_workers.kv.integrity import IntegrityTracker, NullIntegrityTracker
from gpu_workers.kv.pool import OutOfPages, PagePool
from gpu_workers.kv.prefix_cache import PrefixCache, page_hash

log = logging.getLogger(__name__)


@dataclass
class PageTable:
    """The pages a sequence holds, the generation it expects of each, and the hashes of its full pages."""

    salt: bytes = b""
    pages: list[int] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)


class PageManager:
    """Owns the page pool of one engine: allocation, sharing through the prefix cache, integrity tags."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        integrity: IntegrityTracker | NullIntegrityTracker | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.integrity = integrity or NullIntegrityTracker()
        self.prefix_cache = prefix_cache

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: free ones plus cached pages nobody references."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return self.pool.num_free + evictable

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - self.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, table: PageTable, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) - len(table.pages) <= self.num_free

    def grow(self, table: PageTable, num_tokens: int) -> None:
        """Append pages until the table holds ``num_tokens``; raises OutOfPages if they are not there."""
        missing = self.pages_needed(num_tokens) - len(table.pages)
        if missing <= 0:
            return
        if missing > self.num_free:
            raise OutOfPages(f"asked for {missing} pages, {self.num_free} available")
        while self.pool.num_free < missing:
            self.pool.free(self.prefix_cache.evict())
        pages = self.pool.allocate(missing)
        table.pages.extend(pages)
        table.generations.extend(self.integrity.bump(pages))

    def match_prefix(
        self, table: PageTable, tokens: list[int], num_tokens: int, multiple: int | None = None
    ) -> int:
        """Attach cached pages that begin ``tokens`` to an empty table, keeping room for ``num_tokens``.

        Returns the number of tokens served from cache (0 when the pages the rest needs are not available;
        then nothing is attached): a multiple of ``multiple`` tokens (itself whole pages; default one
        page). At least one token is always left to compute, for its logits.
        """
        if self.prefix_cache is None or table.pages:
            return 0
        hits = self.prefix_cache.match(
            table.salt,
            tokens,
            self.page_size,
            (len(tokens) - 1) // self.page_size,
            self.integrity.generation_of,
        )
        per = (multiple or self.page_size) // self.page_size
        hits = hits[: len(hits) // per * per]
        revived = sum(self.prefix_cache.is_evictable(page) for page, _, _ in hits)
        if self.pages_needed(num_tokens) - len(hits) > self.num_free - revived:
            return 0
        for page, h, generation in hits:
            self.pool.incref(page)
            self.prefix_cache.touch(page)
            table.pages.append(page)
            table.hashes.append(h)
            if generation is not None:
                table.generations.append(generation)
        return len(hits) * self.page_size

    def count_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.query_tokens += prompt_tokens
            self.prefix_cache.hit_tokens += hit_tokens

    def publish(self, table: PageTable, tokens: Callable[[int, int], list[int]], num_computed: int) -> None:
        """Add the table's pages that are now full and computed to the prefix cache.

        ``tokens(start, end)`` gives the sequence's token ids; only newly full pages are read, so the
        per-step cost does not grow with the sequence.
        """
        if self.prefix_cache is None:
            return
        for i in range(len(table.hashes), num_computed // self.page_size):
            chunk = tokens(i * self.page_size, (i + 1) * self.page_size)
            h = page_hash(table.salt, table.hashes[-1] if table.hashes else b"", chunk)
            # The generation this table holds the page at, not the live one: if the page was already
            # taken from the table, the entry is born stale and a match drops it.
            generation = table.generations[i] if table.generations else None
            self.prefix_cache.insert(table.pages[i], h, chunk, generation)
            table.hashes.append(h)

    def release(self, table: PageTable) -> None:
        """Drop the table's references; unreferenced pages become cached-evictable or free.

        An entry whose page was reallocated (its generation moved on) is not this table's reference any
        more: the page belongs to its new owner, so releasing it would free that owner's page.
        """
        owned = self._owned(table)
        # Tail pages first, so the LRU evicts the end of a prefix before its beginning.
        for page in self.pool.decref(owned[::-1]):
            if self.prefix_cache is None or not self.prefix_cache.park(page):
                self.pool.free(page)
        table.pages.clear()
        table.generations.clear()
        table.hashes.clear()

    def _owned(self, table: PageTable) -> list[int]:
        if not table.generations:  # checking is off: nothing to tell a stale entry by
            return table.pages
        owned = []
        current = self.integrity.current(table.pages)
        for page, expected, found in zip(table.pages, table.generations, current, strict=True):
            if expected == found:
                owned.append(page)
            else:
                log.warning(
                    "not releasing KV page %d: it was reallocated (expected generation %d, found %d)",
                    page,
                    expected,
                    found,
                )
        return owned

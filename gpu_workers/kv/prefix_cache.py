"""Tenant-scoped prefix cache over full KV pages.

A page is keyed by a hash chain: hash(salt, parent page's hash, this page's token ids). The salt is
derived server-side from the tenant (requests without a tenant get a random one), so two tenants never
share a page even for identical prompts. A hit also compares the stored token ids, so a hash collision
cannot serve the wrong tokens. Cached pages nobody references wait in LRU order and are evicted only when
the pool needs pages; a referenced page is never evictable.

An entry also records the page's integrity generation when it was published. A match compares it with
the page's current generation: a page reallocated behind the cache's back (an allocator bug), or an entry
whose page id changed, no longer holds the tokens it was published for, so the entry is dropped, counted
in ``stale_entries``, and the prefix is computed again instead of serving another owner's KV.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


def prefix_cache_salt(secret: bytes, tenant: str | None) -> bytes:
    """Salt for a tenant's hash chain; without a tenant, a fresh salt so nothing is shared."""
    if tenant is None:
        return os.urandom(16)
    return hmac.new(secret, b"tenant\x00" + tenant.encode(), hashlib.sha256).digest()[:16]


def page_hash(salt: bytes, parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(salt + parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class CachedPage:
    page: int
    generation: int | None  # the page's integrity tag when it was published; None with checking off
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self) -> None:
        self._entries: dict[bytes, CachedPage] = {}  # hash -> the page that holds it
        self._hash_of: dict[int, bytes] = {}  # page -> the hash it was published under
        # Unreferenced pages, LRU first. A page whose entry was dropped as stale may wait here without one.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.query_tokens = 0
        self.hit_tokens = 0
        self.stale_entries = 0

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def __contains__(self, page: int) -> bool:
        return page in self._hash_of

    def match(
        self,
        salt: bytes,
        tokens: list[int],
        page_size: int,
        max_pages: int,
        generation_of: Callable[[int], int | None],
    ) -> list[tuple[int, bytes, int | None]]:
        """Longest run of cached full pages that begins the token sequence: [(page, hash, generation), ...].

        ``generation_of(page)`` is the page's current integrity generation; an entry published at another
        generation is dropped and ends the run.
        """
        hits: list[tuple[int, bytes, int | None]] = []
        parent = b""
        for i in range(max_pages):
            chunk = tokens[i * page_size : (i + 1) * page_size]
            h = page_hash(salt, parent, chunk)
            entry = self._entries.get(h)
            if entry is None or entry.tokens != tuple(chunk):
                break
            found = generation_of(entry.page)
            if found != entry.generation:
                self._drop_stale(h, entry, found)
                break
            hits.append((entry.page, h, entry.generation))
            parent = h
        return hits

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def insert(self, page: int, h: bytes, tokens: list[int], generation: int | None) -> None:
        """Publish a full, computed page; if another page already holds this hash, keep that one."""
        if h not in self._entries and page not in self._hash_of:
            self._entries[h] = CachedPage(page, generation, tuple(tokens))
            self._hash_of[page] = h

    def touch(self, page: int) -> None:
        """The page gained a reference: it is no longer evictable."""
        self._evictable.pop(page, None)

    def park(self, page: int) -> bool:
        """The page lost its last reference; keep it cached (True) if it holds a published prefix."""
        if page in self._hash_of:
            self._evictable[page] = None
            return True
        return False

    def evict(self) -> int:
        """Forget the least recently used unreferenced page and return it for reallocation."""
        page, _ = self._evictable.popitem(last=False)
        h = self._hash_of.pop(page, None)
        if h is not None:
            del self._entries[h]
        return page

    def _drop_stale(self, h: bytes, entry: CachedPage, found: int | None) -> None:
        self.stale_entries += 1
        log.warning(
            "prefix cache entry for page %d is stale (published at generation %s, page now at %s): "
            "dropped; the prefix is computed again",
            entry.page,
            entry.generation,
            found,
        )
        del self._entries[h]
        # The page that published the hash: normally entry.page; if the entry's page id was corrupted,
        # only the reverse index still knows it (a scan, but this path runs only after a bug).
        publisher = entry.page if self._hash_of.get(entry.page) == h else None
        if publisher is None:
            publisher = next((p for p, ph in self._hash_of.items() if ph == h), None)
        if publisher is not None:
            # If it waits unreferenced in the LRU, it stays there without an entry: evicted like a free page.
            del self._hash_of[publisher]

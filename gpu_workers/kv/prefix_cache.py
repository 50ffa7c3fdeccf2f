"""Tenant-scoped prefix cache over full KV pages.

A page is keyed by a hash chain: hash(salt, parent page's hash, this page's token ids). The salt is
derived server-side from the tenant (requests without a tenant get a random one), so two tenants never
share a page even for identical prompts. A hit also compares the stored token ids, so a hash collision
cannot serve the wrong tokens. Cached pages nobody references wait in LRU order and are evicted only when
the pool needs pages; a referenced page is never evictable.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from array import array
from collections import OrderedDict


def prefix_cache_salt(secret: bytes, tenant: str | None) -> bytes:
    """Salt for a tenant's hash chain; without a tenant, a fresh salt so nothing is shared."""
    if tenant is None:
        return os.urandom(16)
    return hmac.new(secret, b"tenant\x00" + tenant.encode(), hashlib.sha256).digest()[:16]


def page_hash(salt: bytes, parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(salt + parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._entry: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # page -> (hash, token ids)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first
        self.query_tokens = 0
        self.hit_tokens = 0

    @property
    def num_cached(self) -> int:
        return len(self._entry)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def __contains__(self, page: int) -> bool:
        return page in self._entry

    def match(
        self, salt: bytes, tokens: list[int], page_size: int, max_pages: int
    ) -> list[tuple[int, bytes]]:
        """Longest run of cached full pages that begins the token sequence: [(page, hash), ...]."""
        hits: list[tuple[int, bytes]] = []
        parent = b""
        for i in range(max_pages):
            chunk = tokens[i * page_size : (i + 1) * page_size]
            h = page_hash(salt, parent, chunk)
            page = self._page_of.get(h)
            if page is None or self._entry[page][1] != tuple(chunk):
                break
            hits.append((page, h))
            parent = h
        return hits

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def insert(self, page: int, h: bytes, tokens: list[int]) -> None:
        """Publish a full, computed page; if another page already holds this hash, keep that one."""
        if h not in self._page_of and page not in self._entry:
            self._page_of[h] = page
            self._entry[page] = (h, tuple(tokens))

    def touch(self, page: int) -> None:
        """The page gained a reference: it is no longer evictable."""
        self._evictable.pop(page, None)

    def park(self, page: int) -> bool:
        """The page lost its last reference; keep it cached (True) if it holds a published prefix."""
        if page in self._entry:
            self._evictable[page] = None
            return True
        return False

    def evict(self) -> int:
        """Forget the least recently used unreferenced page and return it for reallocation."""
        page, _ = self._evictable.popitem(last=False)
        h, _ = self._entry.pop(page)
        del self._page_of[h]
        return page

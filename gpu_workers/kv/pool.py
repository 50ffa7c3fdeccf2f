"""Physical page ids and their reference counts; no tensors live here."""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    """A fixed set of page ids with refcounts. A page is free exactly when its refcount is zero."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self.refcount[page] = 1
        return pages

    def incref(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} is free; only a live page can gain a reference")
        self.refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages whose count reaches zero return to the free list."""
        for page in pages:
            if self.refcount[page] <= 0:
                raise ValueError(f"page {page} released more often than it was referenced")
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self._free.append(page)

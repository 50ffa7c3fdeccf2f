"""Physical page ids and their reference counts; no tensors live here."""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    """A fixed set of page ids with refcounts and a free list.

    A page whose count drops to zero is handed back to the caller, who either frees it or keeps it as a
    cached prefix page (still unreferenced, but not on the free list until evicted).
    """

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self.refcount[page] = 1
        return pages

    def incref(self, page: int) -> None:
        self.refcount[page] += 1

    def decref(self, pages: list[int]) -> list[int]:
        """Drop one reference to each page; return the pages nobody references any more."""
        unreferenced = []
        for page in pages:
            if self.refcount[page] <= 0:
                raise ValueError(f"page {page} released more often than it was referenced")
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                unreferenced.append(page)
        return unreferenced

    def free(self, page: int) -> None:
        if self.refcount[page] != 0:
            raise ValueError(f"page {page} still has {self.refcount[page]} references; it cannot be freed")
        self._free.append(page)

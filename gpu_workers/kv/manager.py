"""Per-sequence page tables over one page pool: grow a table to hold N tokens, release it."""

from __future__ import annotations

from gpu_workers.kv.pool import PagePool


class PageManager:
    """Owns the page pool of one engine; a page table is the list of page ids a sequence holds."""

    def __init__(self, num_pages: int, page_size: int):
        self.pool = PagePool(num_pages)
        self.page_size = page_size

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) - len(table) <= self.pool.num_free

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append pages to ``table`` until it holds ``num_tokens``; raises OutOfPages if they are not free."""
        missing = self.pages_needed(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))

    def release(self, table: list[int]) -> None:
        """Drop the table's references; its pages are free again unless shared."""
        self.pool.release(table)
        table.clear()

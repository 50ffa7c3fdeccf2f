"""Integrity tags: a generation counter per physical page, checked for a whole batch in one compare.

Every (re)allocation of a page gives it a new generation. A sequence records the generation it expects
for each page-table entry, and a prefix-cache entry the generation of the page it published; before a
step reads the cache, the expected generations of every sequence in the batch are compared against the
current ones in a single tensor operation. A mismatch means the sequence would read a page that now
belongs to someone else, so only that sequence is aborted.

Generations come from one counter for the whole pool, not one per page: a value names one allocation of
one page, so an entry whose page id was corrupted into another page's id never matches by coincidence
(two pages each reallocated twice would share generation 2 under per-page counters).

What it catches: page-table and prefix-cache entries that went stale because the page was reallocated or
the entry's page id changed. What it does not: numerical errors, or a page whose contents were corrupted
without a reallocation. ARCHITECTURE.md ("Integrity coverage") lists the operations that are checked.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mismatch:
    row: int  # index of the sequence in the checked batch
    page: int
    expected: int
    found: int


class IntegrityTracker:
    def __init__(self, num_pages: int, device: torch.device | str = "cpu"):
        self.generation = torch.zeros(num_pages, dtype=torch.int64, device=device)
        # On the CPU a check reads the same memory as a numpy array: four array operations, where the
        # torch ones cost several times more (a check runs every step).
        self._host_view = self.generation.numpy() if self.generation.device.type == "cpu" else None
        self._host = [0] * num_pages  # mirror of ``generation`` so recording a tag costs no device sync
        self._last = 0  # the newest generation handed out; 0 means "never allocated"
        self.mismatches = 0

    def bump(self, pages: list[int]) -> list[int]:
        """Mark pages as reallocated; return their new generations (what their new owner expects)."""
        fresh = list(range(self._last + 1, self._last + 1 + len(pages)))
        if not fresh:
            return []
        self._last = fresh[-1]
        for page, generation in zip(pages, fresh, strict=True):
            self._host[page] = generation
        device = self.generation.device
        index = torch.tensor(pages, dtype=torch.long, device=device)
        self.generation[index] = torch.tensor(fresh, dtype=torch.int64, device=device)
        return fresh

    def current(self, pages: list[int]) -> list[int]:
        return [self._host[page] for page in pages]

    def generation_of(self, page: int) -> int | None:
        return self._host[page]

    def verify(self, tables: list[list[int]], expected: list[list[int]]) -> list[Mismatch]:
        """Compare every (page, expected generation) of a batch at once; return the entries that differ."""
        flat_pages = array("q", chain.from_iterable(tables))
        if not flat_pages:
            return []
        expected_flat = array("q", chain.from_iterable(expected))
        if self._host_view is not None:
            want = np.frombuffer(expected_flat, dtype=np.int64)
            found = self._host_view[np.frombuffer(flat_pages, dtype=np.int64)]
            bad = np.flatnonzero(found != want).tolist()
        else:
            device = self.generation.device
            # frombuffer over an array: building the index tensors is the check's main cost, ~2x faster so.
            pages = torch.frombuffer(flat_pages, dtype=torch.int64).to(device)
            want = torch.frombuffer(expected_flat, dtype=torch.int64).to(device)
            found = self.generation[pages]
            bad = (found != want).nonzero().flatten().tolist()
        if not bad:
            return []
        rows = [row for row, table in enumerate(tables) for _ in table]
        out = [Mismatch(rows[i], flat_pages[i], int(want[i]), int(found[i])) for i in bad]
        self.mismatches += len({m.row for m in out})
        for m in out:
            log.warning(
                "kv integrity mismatch: page %d expected generation %d found %d", m.page, m.expected, m.found
            )
        return out


class NullIntegrityTracker:
    """Used when a deployment disables checking: records nothing and checks nothing."""

    mismatches = 0

    def bump(self, pages: list[int]) -> list[int]:
        return []

    def current(self, pages: list[int]) -> list[int]:
        return []

    def generation_of(self, page: int) -> int | None:
        return None

    def verify(self, tables: list[list[int]], expected: list[list[int]]) -> list[Mismatch]:
        return []

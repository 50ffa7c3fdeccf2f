"""Fault injection for integrity tests: make a live page-table entry stale, as an allocator bug would.

Nothing in the serving path imports this module, and it refuses to run unless
TESSERA_ALLOW_FAULT_INJECTION=1 is set, so production cannot trigger it by accident.
"""

from __future__ import annotations

import os

import torch


def reassign_live_page(engine, request_id: str, index: int = 0) -> int:
    """Hand page ``index`` of a running request to another owner behind its back; return the page id.

    The page's generation changes (it was reallocated) and another owner's data overwrites it, while the
    request's page table still points at it: exactly the stale mapping the integrity check must catch.
    """
    if os.environ.get("TESSERA_ALLOW_FAULT_INJECTION") != "1":
        raise RuntimeError("fault injection is disabled; set TESSERA_ALLOW_FAULT_INJECTION=1 in tests only")
    with engine._lock:
        seq = engine._requests[request_id]
        page = seq.table.pages[index]
        engine.pages.integrity.bump([page])
        generator = torch.Generator(device=engine.cache.k.device).manual_seed(page)
        for tensor in (engine.cache.k, engine.cache.v):
            tensor[:, page] = torch.randint(0, 100, tensor[:, page].shape, generator=generator).to(
                tensor.dtype
            )
        return page

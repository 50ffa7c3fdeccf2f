"""Fault injection for integrity tests: create stale page mappings the way allocator bugs do.

Each fault goes through the page manager's real paths (release, grow, eviction) and leaves the engine in
the state the bug would: a table that still maps a page the pool gave to someone else, or a prefix-cache
entry that names the wrong page. Nothing in the serving path imports this module, and it refuses to run
unless TESSERA_ALLOW_FAULT_INJECTION=1 is set, so production cannot trigger it by accident.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gpu_workers.kv.manager import PageTable
from gpu_workers.kv.prefix_cache import page_hash, prefix_cache_salt


@dataclass(frozen=True)
class Injection:
    kind: str
    page: int
    victims: tuple[str, ...]  # requests that map the page now owned by someone else: they must be stopped
    entry: bytes | None = None  # the hash of the corrupted prefix-cache entry (prefix_entry only)


def free_live_page(engine, request_id: str, index: int = 0) -> Injection:
    """Free page ``index`` of a running request while its table still maps it, and let it be reallocated.

    The page's references are dropped and the page freed through the pool (as a double release that
    bypasses the prefix cache would); the pool then hands it to another owner, which writes its own KV
    into it and finishes. Every running request that mapped the page (a shared prefix page has several)
    is a victim; if the page was published, its prefix-cache entry is left stale too.
    """
    _require_opt_in()
    with engine._lock:
        pool = engine.pages.pool
        page = engine._requests[request_id].table.pages[index]
        victims = tuple(rid for rid, seq in engine._requests.items() if page in seq.table.pages)
        pool.decref([page] * pool.refcount[page])
        pool.free(page)
        _reallocate(engine, page)
        return Injection("free_live_page", page, victims)


def corrupt_prefix_entry(
    engine, tenant: str | None, tokens: list[int], page_index: int, to_page: int
) -> Injection:
    """Point the prefix-cache entry of page ``page_index`` of ``tokens`` (tenant's chain) at ``to_page``.

    The entry keeps its hash and token ids, so only its recorded generation can tell that ``to_page`` is
    not the page it was published for. Nobody maps a page through it yet: no victims.
    """
    _require_opt_in()
    with engine._lock:
        cache, size = engine.pages.prefix_cache, engine.pages.page_size
        salt = prefix_cache_salt(engine._salt_secret, tenant)
        h = b""
        for i in range(page_index + 1):
            h = page_hash(salt, h, tokens[i * size : (i + 1) * size])
        entry = cache._entries.get(h)
        if entry is None:
            raise LookupError(f"page {page_index} of these tokens is not in {tenant!r}'s prefix cache")
        if to_page == entry.page:
            raise ValueError(f"the entry already names page {to_page}; pick another page to corrupt it")
        original, entry.page = entry.page, to_page
        return Injection("prefix_entry", original, (), h)


def _reallocate(engine, page: int) -> None:
    """Another owner takes every free page through the real allocator (so it gets ``page`` whatever the
    free list's order, and nothing is evicted), writes its KV into ``page``, and finishes."""
    manager = engine.pages
    owner = PageTable()
    manager.grow(owner, manager.pool.num_free * manager.page_size)
    generator = torch.Generator(device=engine.cache.k.device).manual_seed(page)
    for tensor in (engine.cache.k, engine.cache.v):
        noise = torch.randint(0, 100, tensor[:, page].shape, generator=generator, device=tensor.device)
        tensor[:, page] = noise.to(tensor.dtype)
    manager.release(owner)


def _require_opt_in() -> None:
    if os.environ.get("TESSERA_ALLOW_FAULT_INJECTION") != "1":
        raise RuntimeError("fault injection is disabled; set TESSERA_ALLOW_FAULT_INJECTION=1 in tests only")

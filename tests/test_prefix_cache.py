"""Tenant-scoped prefix cache: hits within a tenant, no sharing across tenants, safe eviction."""

from __future__ import annotations

import random

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.kv import prefix_cache as pc
from gpu_workers.kv.prefix_cache import PrefixCache, prefix_cache_salt

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4
PAGE = 4


def make_engine(path, **overrides) -> Engine:
    config = dict(dtype="float32", kv_budget_bytes=4 * 2**20, page_size=PAGE, max_num_batched_tokens=64)
    config.update(overrides)
    return Engine.from_pretrained(path, EngineConfig(**config))


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(2, 120) for _ in range(n)]


def test_second_identical_prompt_from_the_same_tenant_hits_every_full_page(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    p = prompt(7 * PAGE + 3)
    first = engine.generate([p], GREEDY, tenant="acme")[0]
    second = engine.generate([p], GREEDY, tenant="acme")[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 7 * PAGE
    assert second.token_ids == first.token_ids
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 7 * PAGE
    assert stats["prefix_cache_query_tokens"] == 2 * len(p)


def test_a_prompt_of_whole_pages_still_computes_its_last_token(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    p = prompt(4 * PAGE, seed=2)
    first = engine.generate([p], GREEDY, tenant="acme")[0]
    second = engine.generate([p], GREEDY, tenant="acme")[0]
    assert second.cached_tokens == 3 * PAGE
    assert second.token_ids == first.token_ids


def test_cross_tenant_prompt_never_hits_cache_and_shares_no_page(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    p = prompt(6 * PAGE + 1, seed=3)
    engine.generate([p], GREEDY, tenant="acme")
    engine.add_request(p, GREEDY, request_id="a", tenant="acme")
    engine.add_request(p, GREEDY, request_id="b", tenant="globex")
    engine.step()
    a, b = engine._requests["a"], engine._requests["b"]
    assert a.cached_tokens == 6 * PAGE and b.cached_tokens == 0
    assert not set(a.table.pages) & set(b.table.pages)
    while engine.has_unfinished():
        engine.step()
    assert engine.generate([p], GREEDY)[0].cached_tokens == 0  # no tenant: a private salt


def test_eviction_under_pressure_never_takes_a_page_in_use(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, kv_budget_bytes=64 * TOKEN_BYTES, max_num_batched_tokens=16)
    rng = random.Random(5)
    shared = prompt(3 * PAGE, seed=9)
    for i in range(40):
        tail = [rng.randrange(2, 120) for _ in range(rng.randrange(1, 12))]
        engine.add_request(shared + tail, GREEDY, request_id=f"r{i}", tenant=rng.choice(["acme", "globex"]))
        for _ in range(rng.randrange(0, 3)):
            engine.step()
            cache = engine.pages.prefix_cache
            in_use = {page for seq in engine.scheduler.running for page in seq.table.pages}
            assert not in_use & set(cache._evictable)
            assert all(engine.pages.pool.refcount[p] == 0 for p in cache._evictable)
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["integrity_mismatches"] == 0
    assert all(count == 0 for count in engine.pages.pool.refcount)
    assert stats["kv_pages_used"] == 0


def test_hash_collision_is_caught_by_comparing_token_ids(monkeypatch):
    monkeypatch.setattr(pc, "page_hash", lambda salt, parent, tokens: b"same")
    cache = PrefixCache()
    cache.insert(0, pc.page_hash(b"s", b"", [1, 2]), [1, 2], None)
    assert cache.match(b"s", [1, 2, 9], 2, 1, lambda page: None) == [(0, b"same", None)]
    assert cache.match(b"s", [3, 4, 9], 2, 1, lambda page: None) == []


def test_tenant_salts_are_stable_per_tenant_and_private_without_one():
    secret = b"k" * 32
    assert prefix_cache_salt(secret, "acme") == prefix_cache_salt(secret, "acme")
    assert prefix_cache_salt(secret, "acme") != prefix_cache_salt(secret, "globex")
    assert prefix_cache_salt(secret, "acme") != prefix_cache_salt(b"x" * 32, "acme")
    assert prefix_cache_salt(secret, None) != prefix_cache_salt(secret, None)


def test_disabled_prefix_cache_reports_zero(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, prefix_cache=False)
    p = prompt(5 * PAGE + 1)
    engine.generate([p], GREEDY, tenant="acme")
    assert engine.generate([p], GREEDY, tenant="acme")[0].cached_tokens == 0


def test_stale_entry_for_a_reallocated_page_is_dropped_counted_and_never_served(tiny_llama_dir):
    # The allocator bug the tags exist for: the pool takes back a parked prefix page while the cache still
    # lists it, and hands it to another tenant's request, which writes its own KV there.
    engine = make_engine(tiny_llama_dir, kv_budget_bytes=32 * TOKEN_BYTES)
    p = prompt(5 * PAGE + 1, seed=11)
    rid = engine.add_request(p, GREEDY, tenant="acme")
    engine.step()
    page = engine._requests[rid].table.pages[0]
    while engine.has_unfinished():
        engine.step()
    first = engine.generate([p], GREEDY, tenant="acme")[0]
    del engine.pages.prefix_cache._evictable[page]
    engine.pages.pool.free(page)
    before = engine.pages.integrity.current([page])
    other = 0
    while engine.pages.integrity.current([page]) == before:  # until the pool hands the page out again
        engine.generate([prompt(2 * PAGE, seed=100 + other)], GREEDY, tenant="globex")
        other += 1
    second = engine.generate([p], GREEDY, tenant="acme")[0]
    assert second.cached_tokens == 0  # the chain breaks at its first page: nothing after it is served
    assert second.token_ids == first.token_ids
    assert engine.stats()["prefix_cache_stale_entries"] == 1
    third = engine.generate([p], GREEDY, tenant="acme")[0]  # the recomputed pages were published again
    assert third.cached_tokens == 5 * PAGE and third.token_ids == first.token_ids
    assert engine.stats()["prefix_cache_stale_entries"] == 1

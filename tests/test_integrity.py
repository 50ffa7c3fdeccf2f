"""Integrity tags: a stale page mapping aborts exactly its request; no false alarms in normal serving."""

from __future__ import annotations

import random

import pytest

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.kv.integrity import IntegrityTracker, NullIntegrityTracker
from gpu_workers.tools.faults import corrupt_prefix_entry, free_live_page

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # tiny_llama: layers * (K, V) * kv_heads * head_dim * fp32


@pytest.fixture(autouse=True)
def allow_faults(monkeypatch):
    monkeypatch.setenv("TESSERA_ALLOW_FAULT_INJECTION", "1")


def make_engine(path, **overrides) -> Engine:
    config = dict(dtype="float32", kv_budget_bytes=4 * 2**20, page_size=4, max_num_batched_tokens=64)
    config.update(overrides)
    return Engine.from_pretrained(path, EngineConfig(**config))


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 120) for _ in range(rng.randrange(6, 40))] for _ in range(n)]


def run(engine, batch, fault_at=None, fault_request=None):
    outputs, finish = {}, {}

    def record(event):
        outputs.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finish_reason:
            finish[event.request_id] = event

    for i, prompt in enumerate(batch):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}", on_event=record)
    steps = 0
    while engine.has_unfinished():
        if steps == fault_at:
            free_live_page(engine, fault_request, index=0)
        engine.step()
        steps += 1
    return outputs, finish


def test_stale_mapping_aborts_exactly_the_affected_request(tiny_llama_dir, caplog):
    batch = prompts(8)
    clean, _ = run(make_engine(tiny_llama_dir), batch)
    engine = make_engine(tiny_llama_dir)
    outputs, finish = run(engine, batch, fault_at=3, fault_request="r5")
    assert finish["r5"].finish_reason == "error"
    assert finish["r5"].error.code == "kv_integrity_violation"
    for i in range(8):
        if i != 5:
            assert finish[f"r{i}"].finish_reason == "length"
            assert outputs[f"r{i}"] == clean[f"r{i}"]
    assert engine.stats()["integrity_mismatches"] == 1
    assert engine.stats()["kv_pages_used"] == 0
    assert "expected generation" in caplog.text and "found" in caplog.text


def test_with_checking_off_a_corrupted_prefix_entry_serves_another_tenants_kv(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, integrity_check=False)
    assert isinstance(engine.pages.integrity, NullIntegrityTracker)
    ours, theirs = prompts(2, seed=4)
    ours, theirs = ours + [7] * 8, theirs + [9] * 8  # at least two full pages each
    clean = engine.generate([ours], GREEDY, tenant="acme")[0]
    rid = engine.add_request(theirs, GREEDY, tenant="globex")
    engine.step()
    their_page = engine._requests[rid].table.pages[0]
    while engine.has_unfinished():
        engine.step()
    corrupt_prefix_entry(engine, "acme", ours, 0, to_page=their_page)
    served = engine.generate([ours], GREEDY, tenant="acme")[0]
    # Without the check nothing notices: the request reads globex's page as its own first page.
    assert served.cached_tokens > 0 and served.token_ids != clean.token_ids
    assert engine.stats()["integrity_mismatches"] == engine.stats()["prefix_cache_stale_entries"] == 0


def test_with_checking_on_the_same_corrupted_entry_is_dropped_and_recomputed(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ours, theirs = prompts(2, seed=4)
    ours, theirs = ours + [7] * 8, theirs + [9] * 8
    clean = engine.generate([ours], GREEDY, tenant="acme")[0]
    rid = engine.add_request(theirs, GREEDY, tenant="globex")
    engine.step()
    their_page = engine._requests[rid].table.pages[0]
    while engine.has_unfinished():
        engine.step()
    corrupt_prefix_entry(engine, "acme", ours, 0, to_page=their_page)
    served = engine.generate([ours], GREEDY, tenant="acme")[0]
    assert served.cached_tokens == 0 and served.token_ids == clean.token_ids
    assert engine.stats()["prefix_cache_stale_entries"] == 1
    assert engine.stats()["kv_pages_used"] == 0


def test_a_caught_victim_never_releases_the_page_its_new_owner_holds(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    # 10 prompt tokens in pages of 4: the victim's next token fits its last page, so the next allocation
    # after the fault is the owner's.
    batch = [prompts(1, seed=6)[0][:10], prompts(1, seed=7)[0]]
    clean, _ = run(make_engine(tiny_llama_dir), batch)
    outputs, finish = {}, {}

    def record(event):
        outputs.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finish_reason:
            finish[event.request_id] = event

    engine.add_request(batch[0], GREEDY, request_id="victim", on_event=record)
    engine.step()
    injection = free_live_page(engine, "victim", index=-1)  # not full, so not parked in the prefix cache
    assert injection.victims == ("victim",)
    assert engine.pages.pool.refcount[injection.page] == 0  # released through the pool, not just retagged
    # The next request gets the freed page from the pool while the victim's table still maps it.
    engine.add_request(batch[1], GREEDY, request_id="owner", on_event=record)
    while "owner" not in engine._requests or injection.page not in engine._requests["owner"].table.pages:
        engine.step()
        assert "owner" not in finish
    while engine.has_unfinished():
        engine.step()
    assert finish["victim"].error.code == "kv_integrity_violation"
    assert outputs["victim"] == clean["r0"][: len(outputs["victim"])]  # nothing read after the fault
    assert finish["owner"].finish_reason == "length" and outputs["owner"] == clean["r1"]
    assert engine.stats()["integrity_mismatches"] == 1
    assert all(count == 0 for count in engine.pages.pool.refcount)


def test_a_table_entry_pointed_at_another_page_is_caught_even_when_both_were_allocated_once(tiny_llama_dir):
    # Per-page counters would give both pages generation 1 here; a tag names one allocation, so they differ.
    batch = prompts(2, seed=8)
    clean, _ = run(make_engine(tiny_llama_dir), batch)
    engine = make_engine(tiny_llama_dir)
    outputs, finish = {}, {}

    def record(event):
        outputs.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finish_reason:
            finish[event.request_id] = event

    for i, prompt in enumerate(batch):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}", on_event=record)
    engine.step()
    victim, other = engine._requests["r0"], engine._requests["r1"]
    victim.table.pages[0] = other.table.pages[-1]  # the bug: a table write with the wrong page id
    while engine.has_unfinished():
        engine.step()
    assert finish["r0"].error.code == "kv_integrity_violation"
    assert finish["r1"].finish_reason == "length" and outputs["r1"] == clean["r1"]
    # The page the entry lost is leaked, not freed: nothing can tell whose reference it was.
    assert engine.stats()["kv_pages_used"] == 1


def test_batched_verify_reports_page_expected_and_found():
    tracker = IntegrityTracker(8)
    gens = tracker.bump([1, 2, 3])
    assert tracker.verify([[1, 2], [3]], [gens[:2], gens[2:]]) == []
    assert gens == [1, 2, 3]  # one counter for the pool: every allocation gets a value no page had
    tracker.bump([3])
    [m] = tracker.verify([[1, 2], [3]], [gens[:2], gens[2:]])
    assert (m.row, m.page, m.expected, m.found) == (1, 3, 3, 4)


def test_long_random_run_with_preemption_sharing_and_aborts_has_no_false_mismatch(tiny_llama_dir):
    rng = random.Random(1)
    engine = make_engine(tiny_llama_dir, kv_budget_bytes=128 * TOKEN_BYTES, max_num_batched_tokens=24)
    system = [rng.randrange(2, 120) for _ in range(12)]
    alone = make_engine(tiny_llama_dir, prefix_cache=False)
    expected, finished, outputs = {}, {}, {}
    n = 0
    for step in range(400):
        if n < 60 and rng.random() < 0.5:
            prompt = system + [rng.randrange(2, 120) for _ in range(rng.randrange(1, 20))]
            tenant = rng.choice(["acme", "globex", None])
            rid = f"r{n}"
            expected[rid] = alone.generate([prompt], GREEDY)[0].token_ids
            engine.add_request(prompt, GREEDY, request_id=rid, tenant=tenant)
            n += 1
        if rng.random() < 0.05 and engine._requests:
            engine.abort(rng.choice(sorted(engine._requests)))
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finish_reason:
                finished[event.request_id] = event.finish_reason
        if step > 200 and not engine.has_unfinished():
            break
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["integrity_mismatches"] == 0
    assert "error" not in finished.values()
    completed = [rid for rid, reason in finished.items() if reason == "length"]
    assert len(completed) > 30
    assert all(outputs[rid] == expected[rid] for rid in completed)
    assert all(count == 0 for count in engine.pages.pool.refcount)
    assert stats["kv_pages_used"] == 0

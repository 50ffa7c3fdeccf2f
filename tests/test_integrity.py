"""Integrity tags: a stale page mapping aborts exactly its request; no false alarms in normal serving."""

from __future__ import annotations

import random

import pytest

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.kv.integrity import IntegrityTracker, NullIntegrityTracker
from gpu_workers.tools.faults import reassign_live_page

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
            reassign_live_page(engine, fault_request, index=0)
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


def test_with_checking_off_the_tracker_is_a_no_op(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, integrity_check=False)
    assert isinstance(engine.pages.integrity, NullIntegrityTracker)
    _, finish = run(engine, prompts(8), fault_at=3, fault_request="r5")
    # Without the check nothing notices the stale page: the request reads it and finishes normally.
    assert finish["r5"].finish_reason == "length"
    assert engine.stats()["integrity_mismatches"] == 0


def test_batched_verify_reports_page_expected_and_found():
    tracker = IntegrityTracker(8)
    gens = tracker.bump([1, 2, 3])
    assert tracker.verify([[1, 2], [3]], [gens[:2], gens[2:]]) == []
    tracker.bump([3])
    [m] = tracker.verify([[1, 2], [3]], [gens[:2], gens[2:]])
    assert (m.row, m.page, m.expected, m.found) == (1, 3, 1, 2)


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

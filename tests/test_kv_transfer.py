"""Prefill → decode hand-off inside the engine: export a prompt's KV, import it into another engine."""

from __future__ import annotations

import random
import threading

import torch

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.kv import KVCache
from gpu_workers.kv.transfer import KVBlock

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(path, **overrides) -> Engine:
    config = dict(dtype="float32", kv_budget_bytes=4 * 2**20, page_size=4)
    config.update(overrides)
    return Engine.from_pretrained(path, EngineConfig(**config))


def prompt(seed=0, n=23):
    rng = random.Random(seed)
    return [rng.randrange(2, 120) for _ in range(n)]


def export(prefill: Engine, p, kv_format: str, first: SamplingParams | None = None):
    """Prefill ``p`` for one token and export its KV; returns the final event (token ids, ``kv``)."""
    events = []
    prefill.add_request(
        p, first or SamplingParams(temperature=0, max_tokens=1), export_kv=kv_format, on_event=events.append
    )
    while prefill.has_unfinished():
        prefill.step()
    assert events[-1].finish_reason == "length", events[-1].error
    return events[-1]


def handoff(prefill: Engine, decode: Engine, p, kv_format: str):
    first = prefill.generate([p], SamplingParams(temperature=0, max_tokens=1), tenant=None)
    # generate() has no export flag: go through add_request to ask for the KV.
    final = export(prefill, p, kv_format)
    assert final.token_ids == first[0].token_ids
    block = final.kv
    rest = SamplingParams(temperature=0.0, max_tokens=PARAMS.max_tokens - 1, ignore_eos=True)
    out = []
    decode.add_request(p + final.token_ids, rest, kv_import=block, on_event=lambda e: out.extend(e.token_ids))
    while decode.has_unfinished():
        decode.step()
    return block, final.token_ids + out


def stored(engine: Engine, pages: list[int], num_tokens: int):
    """What the cache holds for tokens [0, num_tokens) in ``pages``: K and V as stored (FP8 bits) and the
    per-page K and V scales (None when unquantised)."""
    cache, size = engine.cache, engine.cache.page_size
    slots = [pages[t // size] * size + t % size for t in range(num_tokens)]
    layers, _, _, heads, dim = cache.k.shape
    k = cache.k.reshape(layers, -1, heads, dim)[:, slots]
    v = cache.v.reshape(layers, -1, heads, dim)[:, slots]
    if cache.k_scale is None:
        return k, v, None, None
    used = pages[: -(-num_tokens // size)]
    return k, v, cache.k_scale[:, used], cache.v_scale[:, used]


def imported(decode: Engine, p, block, request_id="again") -> tuple[list[int], list[int]]:
    """Start a request from ``block`` and return its pages and their expected generations."""
    decode.add_request(p + [5], SamplingParams(max_tokens=4), request_id=request_id, kv_import=block)
    decode.step()  # admits the request and copies the block into its pages
    table = decode._requests[request_id].table
    return list(table.pages), list(table.generations)


def test_lossless_handoff_continues_exactly_like_one_engine(tiny_llama_dir):
    p = prompt()
    colocated = make_engine(tiny_llama_dir).generate([p], PARAMS)[0].token_ids
    decode = make_engine(tiny_llama_dir)
    block, tokens = handoff(make_engine(tiny_llama_dir), decode, p, "fp32")
    assert block.num_tokens == len(p)
    assert tokens == colocated
    stats = decode.stats()
    assert stats["kv_pages_used"] == 0 and stats["integrity_mismatches"] == 0


def test_fp8_handoff_halves_the_bytes_and_keeps_the_values(tiny_llama_dir):
    p = prompt(seed=1)
    prefill = make_engine(tiny_llama_dir)
    decode = make_engine(tiny_llama_dir, kv_cache_dtype="fp8_e4m3")
    fp8_block, tokens = handoff(prefill, decode, p, "fp8_e4m3")
    bf16_block, _ = handoff(prefill, make_engine(tiny_llama_dir, kv_cache_dtype="bf16"), p, "bf16")
    assert fp8_block.k.dtype == torch.uint8
    assert fp8_block.nbytes < 0.52 * bf16_block.nbytes
    k8, _ = fp8_block.dequantized()
    k16, _ = bf16_block.dequantized()
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for values in its normal range.
    big = k16.abs() > 1e-2
    assert ((k8 - k16).abs()[big] / k16.abs()[big]).max() < 0.07
    assert len(tokens) == PARAMS.max_tokens
    # The imported pages hold the block: reading them back gives its bits and its per-page scales.
    pages, _ = imported(decode, p, fp8_block)
    k, v, k_scale, v_scale = stored(decode, pages, fp8_block.num_tokens)
    assert torch.equal(k, fp8_block.k) and torch.equal(v, fp8_block.v)
    assert torch.equal(k_scale, fp8_block.k_scale) and torch.equal(v_scale, fp8_block.v_scale)
    decode.abort("again")
    assert decode.stats()["integrity_mismatches"] == 0


def test_fp8_pages_cross_the_handoff_bit_for_bit(tiny_llama_dir):
    """FP8 prefill -> FP8 decode: every page arrives with the bits and the scale it had, never requantised."""
    p = prompt(seed=5, n=31)
    # A 6-token step budget prefills in chunks, so pages opened by later chunks can get larger scales.
    prefill = make_engine(tiny_llama_dir, kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=6)
    decode = make_engine(tiny_llama_dir, kv_cache_dtype="fp8_e4m3")
    events = []
    prefill.add_request(
        p,
        SamplingParams(temperature=0, max_tokens=1),
        request_id="source",
        export_kv="fp8_e4m3",
        on_event=events.append,
    )
    prefill.step()
    source_pages = list(prefill._requests["source"].table.pages)
    while prefill.has_unfinished():
        prefill.step()
    sent = stored(prefill, source_pages, len(p))
    pages, _ = imported(decode, p, events[-1].kv)
    received = stored(decode, pages, len(p))
    for name, before, after in zip(("k", "v", "k_scale", "v_scale"), sent, received, strict=True):
        assert torch.equal(before, after), name
    decode.abort("again")


def test_imported_pages_get_fresh_integrity_tags(tiny_llama_dir):
    p = prompt(seed=2)
    probe = make_engine(tiny_llama_dir, kv_cache_dtype="fp8_e4m3")
    page_bytes = KVCache.page_bytes(probe.cache.spec, 4, probe.cache.dtype)
    # 7 pages: room for one request at a time, so the import must reuse the previous request's pages.
    decode = make_engine(tiny_llama_dir, kv_cache_dtype="fp8_e4m3", kv_budget_bytes=7 * page_bytes)
    block = export(make_engine(tiny_llama_dir), p, "fp8_e4m3").kv
    decode.add_request(p, SamplingParams(max_tokens=4), request_id="before")
    decode.step()
    table = decode._requests["before"].table
    previous = dict(zip(table.pages, table.generations, strict=True))
    decode.abort("before")

    pages, generations = imported(decode, p, block)
    reused = {page: gen for page, gen in zip(pages, generations, strict=True) if page in previous}
    assert len(reused) >= len(pages) - 1  # 7 pages, 6 taken: at most one was never the previous owner's
    assert all(gen != previous[page] for page, gen in reused.items())
    # The previous owner's view of those pages is stale: the check stops a reader that kept it.
    stale = decode.pages.integrity.verify([list(previous)], [list(previous.values())])
    assert {m.page for m in stale} == set(reused)
    decode.abort("again")


def test_a_block_that_covers_the_whole_prompt_is_rejected(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    block = KVBlock("fp32", 5, torch.zeros(2, 5, 2, 16), torch.zeros(2, 5, 2, 16))
    out = []
    engine.add_request([3] * 5, PARAMS, kv_import=block, on_event=out.append)
    assert out[-1].finish_reason == "error" and out[-1].error.code == "invalid_kv_import"


def test_a_block_for_another_model_fails_only_its_request(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    wrong = KVBlock("fp32", 4, torch.zeros(2, 4, 3, 16), torch.zeros(2, 4, 3, 16))  # 3 KV heads, not 2
    bad, good = [], []
    engine.add_request([3] * 6, PARAMS, kv_import=wrong, on_event=bad.append)
    engine.add_request(prompt(), PARAMS, on_event=good.append)
    while engine.has_unfinished():
        engine.step()
    assert bad[-1].error.code == "invalid_kv_import"
    assert good[-1].finish_reason == "length"
    assert engine.stats()["kv_pages_used"] == 0


def test_seeded_sampling_continues_across_the_handoff(tiny_llama_dir):
    p = prompt(seed=4)
    sampled = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)
    colocated = make_engine(tiny_llama_dir).generate([p], sampled)[0].token_ids
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    first = export(prefill, p, "fp32", SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=1))
    rest = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=9, ignore_eos=True)
    out = []
    decode.add_request(p + first.token_ids, rest, kv_import=first.kv, on_event=out.append)
    while decode.has_unfinished():
        decode.step()
    assert out[-1].finish_reason == "length"
    assert out[-1].cached_tokens == len(p)  # the prompt's KV came through the hand-off, not recomputed
    assert first.token_ids + [t for e in out for t in e.token_ids] == colocated


def test_exported_kv_is_converted_and_delivered_with_the_engine_lock_free(tiny_llama_dir):
    """The hand-off's costly part never holds up the engine: when the final event (with its converted
    block) arrives, another thread can take the engine lock."""
    prefill = make_engine(tiny_llama_dir)
    lock_free_at_delivery = []

    def on_event(event):
        if event.finish_reason is not None:
            other = threading.Thread(target=lambda: lock_free_at_delivery.append(try_lock(prefill)))
            other.start()
            other.join()

    prefill.add_request(prompt(), SamplingParams(max_tokens=1), export_kv="fp8_e4m3", on_event=on_event)
    while prefill.has_unfinished():
        prefill.step()
    assert lock_free_at_delivery == [True]


def try_lock(engine: Engine) -> bool:
    if not engine._lock.acquire(blocking=False):
        return False
    engine._lock.release()
    return True


def test_int8_entries_cross_the_handoff_bit_for_bit_whatever_the_page_size(tiny_llama_dir):
    """INT8 prefill -> INT8 decode with another page size: every entry arrives with its codes and its own
    scale, never requantised, and decoding continues as one engine with the decode pool's pages does."""
    p = prompt(seed=6, n=29)
    prefill = make_engine(tiny_llama_dir, kv_cache_dtype="int8", max_num_batched_tokens=6)
    decode = make_engine(tiny_llama_dir, kv_cache_dtype="int8", page_size=8)
    events = []
    prefill.add_request(
        p,
        SamplingParams(temperature=0, max_tokens=1),
        request_id="source",
        export_kv="int8",
        on_event=events.append,
    )
    prefill.step()
    source_pages = list(prefill._requests["source"].table.pages)
    while prefill.has_unfinished():
        prefill.step()
    block = events[-1].kv
    assert block.kv_format == "int8" and block.k_scale is None and block.head_dim == 16
    sent_k, sent_v, _, _ = stored(prefill, source_pages, len(p))
    assert torch.equal(block.k, sent_k) and torch.equal(block.v, sent_v)
    pages, _ = imported(decode, p, block)
    got_k, got_v, _, _ = stored(decode, pages, len(p))
    assert torch.equal(got_k, sent_k) and torch.equal(got_v, sent_v)
    decode.abort("again")
    assert decode.stats()["integrity_mismatches"] == 0


def test_bf16_prefill_hands_int8_entries_to_an_int8_pool(tiny_llama_dir):
    p = prompt(seed=7)
    prefill = make_engine(tiny_llama_dir)
    int8_block, tokens = handoff(prefill, make_engine(tiny_llama_dir, kv_cache_dtype="int8"), p, "int8")
    bf16_block, _ = handoff(prefill, make_engine(tiny_llama_dir, kv_cache_dtype="bf16"), p, "bf16")
    assert int8_block.k.dtype == torch.int8 and int8_block.k.shape[-1] == 16 + 2
    assert len(tokens) == PARAMS.max_tokens
    k8, v8 = int8_block.dequantized()  # keys rotated back
    for x8, x16 in ((k8, bf16_block.dequantized()[0]), (v8, bf16_block.dequantized()[1])):
        # Each value of an entry (rotated or not: the rotation keeps lengths) within half a code of the
        # entry's amax / 127, which is at most its length: sqrt(dim) / 254 of the length in all, plus the
        # bf16 block's own rounding.
        size = x16.norm(dim=-1)
        assert ((x8 - x16).norm(dim=-1) <= size * (16**0.5 / 254 * 1.01 + 2**-8)).all()

"""The CUDA-graph decode path (``EngineConfig.cuda_graphs``, engine/graphs.py), checked on the CPU.

On a CPU nothing is captured, but every decode step the path serves runs on its static buffers: batches
padded to a bucket, padded rows writing and reading the scratch page, block tables at full width, FP8
pages opened without a masked write. So the tokens must be those of the ordinary step, through requests
that arrive mid-decode (steps mixing prefill and decode take the ordinary path), cross page boundaries
and finish at different times (the batch shrinks through the buckets).
"""

from __future__ import annotations

import random

import pytest
import torch

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.engine.graphs import DecodeGraphs
from gpu_workers.kv import AttentionMetadata, KVCache, KVSpec
from tests.hf_models import save_tiny


def run(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Three requests first, two more after four steps; every request's tokens."""
    outputs: list[list[int]] = [[] for _ in prompts]

    def add(i: int) -> None:
        params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
        engine.add_request(
            prompts[i], params, on_event=lambda event, out=outputs[i]: out.extend(event.token_ids)
        )

    for i in range(3):
        add(i)
    for _ in range(4):
        engine.step()
    for i in range(3, len(prompts)):
        add(i)
    while engine.has_unfinished():
        engine.step()
    return outputs


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
def test_decode_from_static_buffers_gives_the_ordinary_steps_tokens(
    tiny_llama_dir, monkeypatch, kernels, kv_cache_dtype
):
    monkeypatch.setenv("TESSERA_KERNELS", kernels)
    rng = random.Random(5)
    lengths, max_tokens = [3, 17, 30, 15, 40], [21, 5, 34, 12, 26]
    prompts = [[rng.randrange(3, 120) for _ in range(n)] for n in lengths]
    results = {}
    for graphs in (False, True):
        config = EngineConfig(kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, cuda_graphs=graphs)
        engine = Engine.from_pretrained(tiny_llama_dir, config)
        results[graphs] = run(engine, prompts, max_tokens)
        if graphs:
            static = engine.runner.graphs
            # Batches of 1 to 5 rows: buckets 1, 2, 4 and 8 all served, with padded rows.
            assert static.steps > 20 and static.replays == 0  # nothing to capture on a CPU
            assert engine.stats()["cuda_graph_steps"] == static.steps
            assert engine.pages.num_pages == engine.cache.num_pages - 1  # the scratch page is no one's
    assert [len(o) for o in results[True]] == max_tokens
    assert results[True] == results[False]


def check_buffers(static: DecodeGraphs, batch) -> None:
    """The static buffers hold what the ordinary step's metadata says for the batch's rows, and scratch
    (one position on the scratch page, no previous page) for every padded row: no row left from an earlier,
    larger batch."""
    n, page_size = len(batch.seqs), static.cache.page_size
    size = next(b for b in static.buckets if b >= n)
    meta = AttentionMetadata.build(
        [seq.table.pages for seq in batch.seqs],
        [seq.num_computed + 1 for seq in batch.seqs],
        [1] * n,
        page_size,
    )
    width = meta.decode.block_tables.shape[1]
    assert torch.equal(static.slots[:n], meta.slot_mapping)
    assert torch.equal(static.prev_page[:n], meta.spans.prev_page)
    assert torch.equal(static.lens[:n].long(), meta.decode.seq_lens)
    assert torch.equal(static.tables[:n, :width].long(), meta.decode.block_tables)
    assert torch.equal(
        static.tables[:n, width:], static.tables[:n, width - 1 : width].expand(-1, static.width - width)
    )
    assert bool((static.slots[n:size] == static.scratch_slot).all())
    assert bool((static.tables[n:size] == static.cache.scratch_page).all())
    assert bool((static.lens[n:size] == 1).all()) and bool((static.prev_page[n:size] == -1).all())


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
def test_every_static_step_computes_the_ordinary_steps_logits(
    tiny_llama_dir, monkeypatch, kernels, kv_cache_dtype
):
    """Each step the static path serves is computed again on the ordinary path (writing the same K/V to
    the same slots): the logits agree to float32 rounding."""
    monkeypatch.setenv("TESSERA_KERNELS", kernels)
    config = EngineConfig(dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, cuda_graphs=True)
    engine = Engine.from_pretrained(tiny_llama_dir, config)
    runner, static = engine.runner, engine.runner.graphs
    compared = []

    def both(batch):
        rows, logits = DecodeGraphs.run(static, batch)
        check_buffers(static, batch)
        runner.graphs = None
        try:
            ordinary_rows, ordinary = runner.run(batch)
        finally:
            runner.graphs = static
        assert rows == ordinary_rows
        torch.testing.assert_close(logits, ordinary, rtol=0, atol=1e-4 * float(ordinary.abs().max()))
        compared.append(len(rows))
        return rows, logits

    monkeypatch.setattr(static, "run", both)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 120) for _ in range(n)] for n in (3, 17, 30, 15, 40)]
    run(engine, prompts, [21, 5, 34, 12, 26])
    assert len(compared) > 20 and {1, 2, 3, 4} <= set(compared)  # 3 rows: padded to a bucket of 4


def test_padded_rows_touch_only_the_scratch_page(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("TESSERA_KERNELS", "reference")
    engine = Engine.from_pretrained(tiny_llama_dir, EngineConfig(max_num_seqs=8, cuda_graphs=True))
    cache, scratch = engine.cache, engine.cache.scratch_page
    for tensor in (cache.k, cache.v):
        tensor[:, scratch].fill_(float("nan"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    two = engine.generate([[5, 6, 7], [9, 10, 11, 12, 13]], params)  # decode batches of 2: bucket 2
    assert torch.isnan(cache.k[:, scratch]).all()  # no padded row, no write there
    three = engine.generate([[5, 6, 7], [9, 10], [40, 41, 42, 43]], params)  # 3 rows in a bucket of 4
    assert engine.runner.graphs.steps >= 10
    # The padded row wrote slot 0 of the scratch page (its one position), nothing else of it; what it
    # read there (NaN, on the reference path, which reads whole pages) poisoned only its own later layers ...
    assert not torch.isnan(cache.k[0, scratch, 0]).any() and torch.isnan(cache.k[:, scratch, 1:]).all()
    # ... and no real row read or wrote the scratch page: no NaN reached a real page
    assert not torch.isnan(cache.k[:, :scratch]).any() and not torch.isnan(cache.v[:, :scratch]).any()
    assert all(o.error is None and len(o.token_ids) == 6 for o in two + three)
    assert three[0].token_ids == two[0].token_ids  # the same prompt, padded or not


def test_models_that_read_tensors_back_to_the_host_refuse_cuda_graphs(tmp_path):
    save_tiny("mixtral", tmp_path)  # MoE routing counts tokens per expert on the host
    with pytest.raises(ValueError, match="cannot run decode steps from CUDA graphs"):
        Engine.from_pretrained(tmp_path, EngineConfig(cuda_graphs=True))
    assert Engine.from_pretrained(tmp_path, EngineConfig()).generate([[5, 6, 7]])[0].error is None


def test_a_cache_of_one_page_cannot_keep_one_aside(tiny_llama_dir):
    probe = Engine.from_pretrained(tiny_llama_dir, EngineConfig())
    one_page = probe.cache.nbytes // probe.cache.num_pages
    assert Engine.from_pretrained(tiny_llama_dir, EngineConfig(kv_budget_bytes=one_page)).pages.num_pages == 1
    with pytest.raises(ValueError, match="keeps one aside"):
        Engine.from_pretrained(tiny_llama_dir, EngineConfig(kv_budget_bytes=one_page, cuda_graphs=True))


def test_fp8_pages_open_to_the_same_scales_with_a_scratch_page(monkeypatch):
    """Opening FP8 pages without a masked write (every token writes a scale, the ones that open no page
    to the scratch page) leaves every real page's scale and bytes as the masked write does."""
    monkeypatch.setenv("TESSERA_KERNELS", "reference")  # the torch write path, where pages are opened
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=8)
    caches = [KVCache(spec, num_pages=9, page_size=4, dtype=torch.float8_e4m3fn) for _ in range(2)]
    caches[1].scratch_page = 8
    gen = torch.Generator().manual_seed(0)
    # Prefill A (6 tokens, pages 0-1) and B (3 tokens, page 2); decode both twice, then B opens page 3.
    # Decode tokens 16x louder than the prompts: a non-opening token that rewrote its page's scale would
    # raise it.
    steps = [
        ([[0, 1], [2]], [6, 3], [6, 3], 1.0),
        ([[0, 1], [2]], [7, 4], [1, 1], 16.0),
        ([[0, 1], [2, 3]], [8, 5], [1, 1], 16.0),
    ]
    for tables, contexts, queries, loudness in steps:
        meta = AttentionMetadata.build(tables, contexts, queries, 4)
        k = torch.randn(meta.num_tokens, 2, 8, generator=gen) * loudness
        v = torch.randn(meta.num_tokens, 2, 8, generator=gen) * loudness
        for cache in caches:
            cache.write(0, k, v, meta.slot_mapping, meta.spans)
    masked, scratch = caches
    assert torch.equal(masked.k_scale[:, :8], scratch.k_scale[:, :8])
    assert torch.equal(masked.v_scale[:, :8], scratch.v_scale[:, :8])
    assert torch.equal(masked.k[:, :8], scratch.k[:, :8]) and torch.equal(masked.v[:, :8], scratch.v[:, :8])
    assert masked.k_scale[0, 3] > masked.k_scale[0, 2]  # B's new page opened at the louder tokens' scale

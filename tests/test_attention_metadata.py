"""Per-step attention metadata (tensor ops, no per-token Python) and the attention it drives."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_workers.formats.fp8 import quantize_fp8
from gpu_workers.kernels.paged_attention import paged_attention_reference, paged_decode_attention_reference
from gpu_workers.kv import AttentionMetadata

PAGE = 4


def scattered_tables(context_lens: list[int], seed: int = 0) -> tuple[list[list[int]], int]:
    pages = sum(-(-c // PAGE) for c in context_lens)
    free = list(range(pages))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-c // PAGE))] for c in context_lens], pages


def cache_of(pages: int, kv: str, gen: torch.Generator):
    """K and V slots of ``pages`` pages (2 KV heads of 16), as fp32 or as FP8 bits with per-page scales."""
    k, v = torch.randn(pages * PAGE, 2, 16, generator=gen), torch.randn(pages * PAGE, 2, 16, generator=gen)
    if kv != "fp8":
        return k, v, (None, None)
    scales = (torch.rand(pages, generator=gen) + 0.1, torch.rand(pages, generator=gen) + 0.1)
    k, v = (
        quantize_fp8(x, s.repeat_interleave(PAGE)[:, None, None]) for x, s in zip((k, v), scales, strict=True)
    )
    return k, v, scales


def test_slots_and_spans_are_those_of_every_new_token():
    context, query = [9, 3, 14, 1], [1, 3, 5, 1]
    tables, _ = scattered_tables(context)
    meta = AttentionMetadata.build(tables, context, query, PAGE)
    expected = [
        table[p // PAGE] * PAGE + p % PAGE
        for table, c, q in zip(tables, context, query, strict=True)
        for p in range(c - q, c)
    ]
    assert meta.slot_mapping.tolist() == expected
    assert meta.spans.token_seq.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    assert meta.spans.prev_page.tolist() == [tables[0][1], -1, tables[2][2], -1]
    assert [(g.tokens.tolist(), g.span, g.context_len) for g in meta.prefill] == [
        ([1, 2, 3], slice(1, 4), 3),
        ([4, 5, 6, 7, 8], slice(4, 9), 14),
    ]
    assert meta.decode.rows.tolist() == [0, 9] and meta.decode.seq_lens.tolist() == [9, 1]


def test_a_decode_only_step_has_the_slots_spans_and_rows_of_every_new_token():
    """A step of one new token per sequence takes a shorter road (``_decode_only``): the same metadata."""
    context = [9, 1, 16, 17, 4, 33]
    tables, _ = scattered_tables(context, seed=3)
    meta = AttentionMetadata.build(tables, context, [1] * len(context), PAGE)
    assert meta.slot_mapping.tolist() == [
        t[(c - 1) // PAGE] * PAGE + (c - 1) % PAGE for t, c in zip(tables, context, strict=True)
    ]
    assert meta.spans.token_seq.tolist() == list(range(len(context)))
    assert meta.spans.prev_page.tolist() == [
        t[(c - 2) // PAGE] if c > 1 else -1 for t, c in zip(tables, context, strict=True)
    ]
    assert meta.prefill == [] and meta.prefill_pages is None
    width = -(-max(context) // PAGE)
    assert meta.decode.rows.tolist() == list(range(len(context)))
    assert meta.decode.seq_lens.tolist() == context
    assert meta.decode.block_tables.tolist() == [t + [t[-1]] * (width - len(t)) for t in tables]
    assert meta.query_lens == [1] * len(context) and meta.context_lens == context


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_many_decode_rows_grouped_by_length_attend_as_the_decode_reference(window, kv):
    rng = random.Random(1)
    context = [rng.randint(1, 60) for _ in range(40)]
    tables, pages = scattered_tables(context)
    meta = AttentionMetadata.build(tables, context, [1] * len(context), PAGE)
    assert len(meta.decode.groups) > 1  # padded per group, not to the longest row
    gen = torch.Generator().manual_seed(0)
    k, v, scales = cache_of(pages, kv, gen)
    q = torch.randn(len(context), 4, 16, generator=gen)
    got = paged_attention_reference(q, k, v, meta, 0.25, window, *scales)
    tables_t = torch.tensor([t + [t[-1]] * (15 - len(t)) for t in tables])
    want = paged_decode_attention_reference(
        q, k, v, tables_t, torch.tensor(context), PAGE, 0.25, window, *scales
    )
    assert torch.allclose(got, want, atol=1e-5)


def test_decode_rows_split_only_where_their_widths_in_pages_differ():
    # 32 rows within one page's worth of length: one width, nothing to save by splitting, one call.
    same = [33 + i % PAGE for i in range(32)]
    assert AttentionMetadata.build(scattered_tables(same)[0], same, [1] * 32, PAGE).decode.groups == []
    # Two widths: quarters of equal width are merged, so the groups are exactly the two widths.
    two = [8] * 24 + [40] * 8
    meta = AttentionMetadata.build(scattered_tables(two)[0], two, [1] * 32, PAGE)
    assert [g.block_tables.shape for g in meta.decode.groups] == [(24, 2), (8, 10)]
    assert sorted(r for g in meta.decode.groups for r in g.rows.tolist()) == list(range(32))


def test_a_prefill_chunk_after_cached_pages_attends_causally_over_the_whole_context():
    context, query = [13], [5]
    tables, pages = scattered_tables(context)
    meta = AttentionMetadata.build(tables, context, query, PAGE)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(pages * PAGE, 2, 16, generator=gen), torch.randn(pages * PAGE, 2, 16, generator=gen)
    q = torch.randn(5, 4, 16, generator=gen)
    got = paged_attention_reference(q, k, v, meta, 0.25)
    slots = torch.tensor([tables[0][p // PAGE] * PAGE + p % PAGE for p in range(13)])
    keys, values = k[slots].repeat_interleave(2, dim=1), v[slots].repeat_interleave(2, dim=1)
    for i, pos in enumerate(range(8, 13)):
        probs = (torch.einsum("hd,lhd->hl", q[i], keys[: pos + 1]) * 0.25).softmax(-1)
        assert torch.allclose(got[i], torch.einsum("hl,lhd->hd", probs, values[: pos + 1]), atol=1e-5)


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_prefill_chunks_of_equal_lengths_attend_in_one_call_bit_for_bit_as_each_alone(kv):
    # Two groups of equal (context, chunk) lengths, interleaved with decode rows and each other, so one
    # group's tokens are not back to back; plus a chunk after cached pages and one of its own length.
    context = [9, 9, 1, 9, 13, 12, 9, 7, 13]
    query = [9, 9, 1, 9, 5, 1, 9, 7, 5]
    tables, pages = scattered_tables(context, seed=3)
    meta = AttentionMetadata.build(tables, context, query, PAGE)
    assert sorted((g.context_len, g.query_len, g.rows, g.span is None) for g in meta.prefill) == [
        (7, 7, 1, False),
        (9, 9, 4, True),  # rows 0, 1, 3, 6: a decode row between them
        (13, 5, 2, True),
    ]
    gen = torch.Generator().manual_seed(4)
    k, v, scales = cache_of(pages, kv, gen)
    q = torch.randn(sum(query), 4, 16, generator=gen)
    got = paged_attention_reference(q, k, v, meta, 0.25, None, *scales)
    start = 0
    for table, c, n in zip(tables, context, query, strict=True):
        alone = AttentionMetadata.build([table], [c], [n], PAGE)
        want = paged_attention_reference(q[start : start + n], k, v, alone, 0.25, None, *scales)
        assert torch.equal(got[start : start + n], want), (c, n)
        start += n

"""The Triton decode attention's page tiles and folded scales, in Triton's interpreter, against the torch
reference.

The kernel reads a tile of positions inside one page and applies that page's FP8 K scale (folded with the
softmax scale and log2(e)) and V scale once per tile; pages narrower than a tile share one, each position
with its own page's scales. Every FP8 page here has its own scale, spread over a factor of eight, so a
scale taken from the wrong page (or a tile that crosses a page) moves the output far beyond tolerance
(``test_a_scale_on_the_wrong_page_would_fail`` shows it). BF16 and INT8 pages run the same tiles.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from gpu_workers.formats.fp8 import quantize_fp8  # noqa: E402
from gpu_workers.formats.kv_int8 import quantize_int8_entries  # noqa: E402
from gpu_workers.kernels import paged_attention_triton  # noqa: E402
from gpu_workers.kernels.paged_attention import paged_decode_attention_reference  # noqa: E402

# Lengths: one key, shorter than a tile, and several pages with a ragged last page and tile at every page
# size tested (1 to 64).
LENS = [1, 13, 150, 77]
HEAD_DIM = 32
TOLERANCE = 1e-5  # of the output's largest magnitude: the kernel computes in fp32 here, as the reference


def paged_case(kv: str, page_size: int, heads: int, kv_heads: int, seed: int = 0):
    """Queries and the (k, v, block tables, lengths, page size) arguments over a shuffled page pool, with
    the pool's per-page (k_scale, v_scale) for FP8 (else None)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in LENS]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.zeros(len(LENS), max(pages_per_seq), dtype=torch.int32)
    for b, count in enumerate(pages_per_seq):
        tables[b, :count] = torch.tensor([order.pop() for _ in range(count)])
    q = torch.randn(len(LENS), heads, HEAD_DIM, generator=gen)
    shape = (num_pages * page_size, kv_heads, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    scales = (None, None)
    if kv == "bf16":
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    elif kv == "int8":  # entries of varied sizes: each scales itself
        sizes = torch.rand(shape[0], kv_heads, 1, generator=gen) * 8
        k, v = quantize_int8_entries(k * sizes), quantize_int8_entries(v * sizes)
    else:
        # Each page's scale in [2^-8, 2^-5), its values about 64 times it (codes well inside e4m3's ±448):
        # a page's values come out right under its own scale only. Quantised with torch (the interpreter's
        # fp8 cast is buggy).
        scales = tuple(2.0 ** (3 * torch.rand(num_pages, generator=gen) - 8) for _ in range(2))
        slot_scales = [s.repeat_interleave(page_size)[:, None, None] for s in scales]
        k, v = (quantize_fp8(x * 64 * s, s) for x, s in zip((k, v), slot_scales, strict=True))
    return q, (k, v, tables, torch.tensor(LENS, dtype=torch.int32), page_size), scales


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=TOLERANCE * ref.abs().max().item())


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bf16", "int8"])
@pytest.mark.parametrize("page_size", [1, 4, 16, 64])  # tiles over 16 pages, 4, one page, half a page
@pytest.mark.parametrize(("heads", "kv_heads", "window", "splits"), [(8, 2, None, 1), (6, 2, 37, 3)])
def test_decode_tiles_pages_and_folds_scales_as_the_reference_attends(
    monkeypatch, kv, page_size, heads, kv_heads, window, splits
):
    # GQA groups of 4 and of 3 (padded rows); a window that starts mid-tile; three splits, the last of
    # the short sequences' empty, merged by their base-2 log-sum-exp.
    monkeypatch.setattr(paged_attention_triton, "_num_splits", lambda *args: splits)
    q, args, scales = paged_case(kv, page_size, heads, kv_heads)
    call = (*args, HEAD_DIM**-0.5, window, *scales)
    out = paged_attention_triton.paged_decode_attention_triton(q, *call)
    assert_close(out, paged_decode_attention_reference(q, *call))


@pytest.mark.parametrize("splits", [2, 5])
def test_splits_merge_to_one_pass_over_fp8_pages(monkeypatch, splits):
    # The split boundaries fall on tiles and pages; the merge weighs each split by the same base as the
    # splits' maxima. Each split count is compared with one split, not only with the reference.
    q, args, scales = paged_case("fp8_e4m3", 16, 8, 2, seed=1)
    call = (*args, HEAD_DIM**-0.5, 40, *scales)
    monkeypatch.setattr(paged_attention_triton, "_num_splits", lambda *args: 1)
    whole = paged_attention_triton.paged_decode_attention_triton(q, *call)
    monkeypatch.setattr(paged_attention_triton, "_num_splits", lambda *args: splits)
    assert_close(paged_attention_triton.paged_decode_attention_triton(q, *call), whole)
    assert_close(whole, paged_decode_attention_reference(q, *call))


@pytest.mark.parametrize("which", ["k", "v"])
def test_a_scale_on_the_wrong_page_would_fail(which):
    # The fixture's own check: the reference with two pages of one sequence swapping their K (or V) scale
    # is far outside the tolerance the kernel is held to, so a kernel that scaled a tile by a neighbouring
    # page's scale (or let a tile cross into the next page) fails the tests above.
    q, args, (k_scale, v_scale) = paged_case("fp8_e4m3", 16, 8, 2)
    tables = args[2]
    first, second = tables[2, 0].item(), tables[2, 1].item()
    swapped = (k_scale if which == "k" else v_scale).clone()
    swapped[[first, second]] = swapped[[second, first]]
    scales = (swapped, v_scale) if which == "k" else (k_scale, swapped)
    ref = paged_decode_attention_reference(q, *args, HEAD_DIM**-0.5, None, k_scale, v_scale)
    wrong = paged_decode_attention_reference(q, *args, HEAD_DIM**-0.5, None, *scales)
    assert (wrong - ref).abs().max() > 100 * TOLERANCE * ref.abs().max()

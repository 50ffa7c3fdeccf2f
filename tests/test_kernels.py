"""Every kernel equals its torch reference on small shapes: the Triton kernels run by Triton's CPU
interpreter, the numba CPU decode attention compiled for this machine.

Tolerances, and why:
- fp32 activations: kernel and reference compute the same products in a different summation order, so
  they agree to fp32 rounding (relative 1e-5 of the output's scale).
- bf16 activations: the reference rounds the dequantised weight to bf16 before its matmul (relative 2^-9
  per weight) and the interpreter truncates fp32→bf16 stores instead of rounding to nearest (found here:
  up to one bf16 step, 2^-8 relative), so they agree to 2^-7 of the output's scale.
- FP8 quantisation inside a kernel (KV write): the interpreter's fp32→fp8 cast drops the carry when
  rounding up crosses a power of two (ENVIRONMENT.md). Values that need no rounding match bit for bit;
  on random values every mismatch must be exactly that bug.
- INT8 KV entries: the write rounds in integer arithmetic and to nearest even by adding 1.5 * 2^23, so the
  Triton and numba writes equal the torch path bit for bit, in the interpreter too.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import random  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from gpu_workers import Engine, EngineConfig, SamplingParams  # noqa: E402
from gpu_workers.formats.fp8 import quantize_fp8  # noqa: E402
from gpu_workers.formats.kv_int8 import dequantize_int8_entries, quantize_int8_entries  # noqa: E402
from gpu_workers.formats.weights import quantize_fp8_weight, quantize_int4  # noqa: E402
from gpu_workers.kernels.fp8_linear_triton import fp8_linear_triton  # noqa: E402
from gpu_workers.kernels.int4_linear_triton import int4_linear_triton, int4_tiles  # noqa: E402
from gpu_workers.kernels.kv_write import rotate_write_kv_reference, write_kv_reference  # noqa: E402
from gpu_workers.kernels.kv_write_triton import rotate_write_kv_triton, write_kv_triton  # noqa: E402
from gpu_workers.kernels.paged_attention import (  # noqa: E402
    paged_attention,
    paged_attention_reference,
    paged_decode_attention_reference,
)
from gpu_workers.kernels.paged_attention_cpu import paged_decode_attention_cpu  # noqa: E402
from gpu_workers.kernels.paged_attention_triton import paged_decode_attention_triton  # noqa: E402
from gpu_workers.kernels.quant_linear import fp8_linear_reference, int4_linear_reference  # noqa: E402
from gpu_workers.kernels.rms_norm import add_rms_norm_reference  # noqa: E402
from gpu_workers.kernels.rms_norm_triton import add_rms_norm_triton  # noqa: E402
from gpu_workers.kernels.silu_mul import silu_mul_reference  # noqa: E402
from gpu_workers.kernels.silu_mul_triton import silu_mul_triton  # noqa: E402
from gpu_workers.kv import AttentionMetadata, KVCache, KVSpec  # noqa: E402
from gpu_workers.tools.quantize import quantize_checkpoint  # noqa: E402


def assert_matches(out: torch.Tensor, ref: torch.Tensor, relative: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=0, atol=relative * ref.float().abs().max().item()
    )


# (batch, out features, in features, group size): decode GEMV, a batch that is not a tile multiple,
# a prefill-sized batch; 200 inputs leave a ragged last group.
GEMM_SHAPES = [(1, 96, 256, 128), (5, 40, 200, 64), (37, 72, 160, 32)]


@pytest.mark.parametrize("split_k", [None, 1, 3])
@pytest.mark.parametrize("symmetric", [False, True])
# Groups of 48 straddle the kernel's K steps: scales are read per input column there.
@pytest.mark.parametrize(("m", "n", "k", "group"), [*GEMM_SHAPES, (3, 40, 144, 48)])
def test_int4_gemm_matches_reference(m, n, k, group, symmetric, split_k):
    """The kernel's own choice of K splits (2 or 3 on these shapes), none, and 3 forced: the bias is
    added once and every split's columns land in the sum."""
    gen = torch.Generator().manual_seed(m)
    q = quantize_int4(torch.randn(n, k, generator=gen), group, symmetric)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    args = (q.weight_packed, q.weight_scale, q.weight_zero, group)
    tiles = int4_tiles(m, n, k, group, x.device)
    assert tiles.split_k > 1
    if split_k is not None:
        tiles = replace(tiles, split_k=split_k)
    out = int4_linear_triton(x, *args, bias, tiles=tiles)
    assert_matches(out, int4_linear_reference(x, *args, bias), 1e-5)
    xb = x.to(torch.bfloat16)
    assert_matches(int4_linear_triton(xb, *args, tiles=tiles), int4_linear_reference(xb, *args), 2**-7)


@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 96, 256, 32), (37, 72, 160, 32)])
def test_int4_gemm_with_gguf_minimums_matches_reference(m, n, k, group):
    """GGUF's Q4_1 form, W = q * scale + min with float16 scales and minimums, as the file stores them."""
    gen = torch.Generator().manual_seed(m)
    q = quantize_int4(torch.randn(n, k, generator=gen), group)
    scale = q.weight_scale.to(torch.float16)
    minimum = (-q.weight_zero.float() * q.weight_scale.float()).to(torch.float16)
    x = torch.randn(m, k, generator=gen)
    args = (q.weight_packed, scale, None, group)
    expected = int4_linear_reference(x, *args, None, minimum)
    assert_matches(int4_linear_triton(x, *args, weight_min=minimum), expected, 1e-5)
    xb = x.to(torch.bfloat16)
    expected = int4_linear_reference(xb, *args, None, minimum)
    assert_matches(int4_linear_triton(xb, *args, weight_min=minimum), expected, 2**-7)


@pytest.mark.parametrize(("m", "n", "k", "group"), GEMM_SHAPES)
def test_fp8_gemm_matches_reference(m, n, k, group):
    gen = torch.Generator().manual_seed(m)
    q = quantize_fp8_weight(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen))
    x, bias = torch.randn(3, m, k, generator=gen), torch.randn(n, generator=gen)  # leading dims flatten
    out = fp8_linear_triton(x, q.weight, q.weight_scale, bias)
    assert_matches(out, fp8_linear_reference(x, q.weight, q.weight_scale, bias), 1e-5)
    xb = x.to(torch.bfloat16)
    assert_matches(
        fp8_linear_triton(xb, q.weight, q.weight_scale),
        fp8_linear_reference(xb, q.weight, q.weight_scale),
        2**-7,
    )


def decode_case(heads, kv_heads, head_dim, page_size, lens, seed=0):
    """Queries and a shuffled page pool holding sequences of ``lens`` tokens; tables padded with page 0."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(pages_per_seq), dtype=torch.int32)
    for b, count in enumerate(pages_per_seq):
        tables[b, :count] = torch.tensor([order.pop() for _ in range(count)])
    shape = (num_pages * page_size, kv_heads, head_dim)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), num_pages


def stored_as(kv: str, k: torch.Tensor, v: torch.Tensor, num_pages: int, page_size: int):
    """fp32 K and V as a cache of format ``kv`` stores them, and its per-page (k, v) scales (None unless FP8)."""
    if kv == "bf16":
        return k.to(torch.bfloat16), v.to(torch.bfloat16), (None, None)
    if kv == "int8":  # entries of varied sizes: each scales itself
        sizes = torch.rand(k.shape[0], k.shape[1], 1, generator=torch.Generator().manual_seed(7)) * 8
        return quantize_int8_entries(k * sizes), quantize_int8_entries(v * sizes), (None, None)
    if kv != "fp8_e4m3":
        return k, v, (None, None)
    # Per-page scales, as KVCache keeps them; quantised with torch (the interpreter's fp8 cast is buggy).
    scales = (torch.rand(num_pages) + 0.01, torch.rand(num_pages) + 0.01)
    k, v = (
        quantize_fp8(x, s.repeat_interleave(page_size)[:, None, None])
        for x, s in zip((k, v), scales, strict=True)
    )
    return k, v, scales


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "window"),
    [
        (4, 2, 32, 4, None),
        (8, 2, 24, 16, None),
        (4, 4, 16, 8, 7),
    ],  # GQA, head_dim not a power of 2, MHA + window
)
@pytest.mark.parametrize(
    ("kernel", "kv"),
    [
        (paged_decode_attention_triton, "bf16"),
        (paged_decode_attention_triton, "fp8_e4m3"),
        (paged_decode_attention_triton, "int8"),
        (paged_decode_attention_cpu, "bf16"),
        (paged_decode_attention_cpu, "fp8_e4m3"),
        (paged_decode_attention_cpu, "int8"),
        (paged_decode_attention_cpu, "fp32"),
    ],
)
def test_paged_decode_attention_matches_reference(heads, kv_heads, head_dim, page_size, window, kernel, kv):
    # Lengths 1 (one key), short, and long enough for several 32-position splits, in one launch.
    q, k, v, tables, lens, num_pages = decode_case(heads, kv_heads, head_dim, page_size, [1, 13, 150])
    k, v, scales = stored_as(kv, k, v, num_pages, page_size)
    args = (k, v, tables, lens, page_size, head_dim**-0.5, window, *scales)
    assert_matches(kernel(q, *args), paged_decode_attention_reference(q, *args), 1e-5)
    qb = q.to(torch.bfloat16)  # bf16 queries: the output store is the one rounding that differs
    assert_matches(kernel(qb, *args), paged_decode_attention_reference(qb, *args), 2**-7)


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "int8", "fp32"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (16, 2), (10, 2)])
def test_cpu_decode_attention_serves_odd_and_large_query_groups(heads, kv_heads, kv):
    # The CPU kernel serves a GQA group's query heads two at a time: a group of 3 leaves one head to serve
    # alone; FP8 groups over four read a widened tile instead, and a group of 5 does both.
    q, k, v, tables, lens, num_pages = decode_case(heads, kv_heads, 32, 8, [1, 6, 77])
    k, v, scales = stored_as(kv, k, v, num_pages, 8)
    args = (k, v, tables, lens, 8, 32**-0.5, None, *scales)
    assert_matches(paged_decode_attention_cpu(q, *args), paged_decode_attention_reference(q, *args), 1e-5)


def test_cpu_decode_attention_reads_every_e4m3_value_exactly():
    """One key per row: its V comes back as the reference dequantises it, for every finite e4m3 pattern."""
    patterns = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    page_size, scales = 4, torch.tensor([2.0**-9, 1.0, 3.0, 2.0**9])  # one page per row, scale of 2^9 too
    v = patterns.repeat(4 * page_size).view(4 * page_size, 1, -1)
    k = torch.zeros_like(v)
    q = torch.randn(4, 2, patterns.numel())
    tables, lens = torch.arange(4, dtype=torch.int32)[:, None], torch.ones(4, dtype=torch.int32)
    args = (k, v, tables, lens, page_size, 0.1, None, scales, scales)
    out = paged_decode_attention_cpu(q, *args)
    torch.testing.assert_close(out, paged_decode_attention_reference(q, *args), rtol=0, atol=0)
    torch.testing.assert_close(out[2, 0], patterns.view(torch.float8_e4m3fn).float() * 3.0, rtol=0, atol=0)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8", "bf16"])
def test_cpu_decode_attention_under_a_sharp_softmax_matches_the_reference(kv):
    """Scores spread over a hundred or more within a row (probabilities from 1 down past e^-64, which the
    kernel counts as 0), and values of very different sizes (V pages scaled by 2^-12 to 2^8, so the FP8 V
    sums' offsets, weights 2^100 up and values 2^120 down, meet small and large page scales): each head's
    output is the reference's to 1e-5 of its own size."""
    q, k, v, tables, lens, num_pages = decode_case(4, 2, 32, 8, [1, 9, 150, 301], seed=3)
    gen = torch.Generator().manual_seed(4)
    k = (
        k
        * (2.0 ** torch.randint(-1, 2, (num_pages,), generator=gen).float()).repeat_interleave(8)[
            :, None, None
        ]
    )
    v = (
        v
        * (2.0 ** torch.randint(-12, 9, (num_pages,), generator=gen).float()).repeat_interleave(8)[
            :, None, None
        ]
    )
    q = q * 12
    spreads = []  # each long row's widest score range over its heads
    for b, n in enumerate(lens.tolist()):
        slots = (tables[b, : -(-n // 8)].long()[:, None] * 8 + torch.arange(8)).flatten()[:n]
        scores = torch.einsum("hd,shd->hs", q[b], k[slots].repeat_interleave(2, dim=1)) * 32**-0.5
        spreads.append((scores.amax(-1) - scores.amin(-1)).max().item())
    assert min(spreads[2:]) > 100  # the long rows reach below e^-64 (and e^-87, the old floor)
    scales = (None, None)
    if kv == "bf16":
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    elif kv == "int8":
        k, v = quantize_int8_entries(k), quantize_int8_entries(v)
    else:
        scales = tuple(x.view(num_pages, -1).abs().amax(-1) / 448 for x in (k, v))
        k, v = (
            quantize_fp8(x, s.repeat_interleave(8)[:, None, None])
            for x, s in zip((k, v), scales, strict=True)
        )
    args = (k, v, tables, lens, 8, 32**-0.5, None, *scales)
    expected = paged_decode_attention_reference(q, *args)
    out = paged_decode_attention_cpu(q, *args)
    size = expected.abs().amax(-1, keepdim=True)  # per row and head
    assert ((out - expected).abs() <= 1e-5 * size).all()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("mode", ["triton", "auto"])  # auto on the CPU: the numba kernel
def test_kernel_attention_equals_kv_reference_for_a_mixed_step(monkeypatch, kv_dtype, mode):
    """Decode rows through the kernel, prefill rows through kv.attention: the same output as the reference."""
    monkeypatch.setenv("TESSERA_KERNELS", mode)
    spec, page_size = KVSpec(num_layers=1, num_kv_heads=2, head_dim=16), 4
    cache = KVCache(spec, num_pages=24, page_size=page_size, dtype=kv_dtype)
    tables = [[3, 9, 1, 7], [0, 2], [5, 6, 4, 8, 10], [11]]
    context, query = [14, 6, 17, 3], [1, 6, 1, 2]  # two decode rows, two prefill chunks
    meta = AttentionMetadata.build(tables, context, query, page_size)
    # Fill every cached position through the cache's own write path (dynamic FP8 scales per page).
    full = AttentionMetadata.build(tables, context, context, page_size)
    gen = torch.Generator().manual_seed(0)
    cache.write(
        0,
        torch.randn(full.num_tokens, 2, 16, generator=gen),
        torch.randn(full.num_tokens, 2, 16, generator=gen),
        full.slot_mapping,
        full.spans,
    )
    q = torch.randn(meta.num_tokens, 4, 16, generator=gen)
    k_slots, v_slots = cache.layer(0)
    args = (k_slots, v_slots, meta, 0.25, None, *cache.layer_scales(0))
    calls = []
    if mode == "auto":  # the dispatch, not only the kernel: count the CPU kernel's calls
        import gpu_workers.kernels.paged_attention_cpu as cpu

        kernel = cpu.paged_decode_attention_cpu
        monkeypatch.setattr(cpu, "paged_decode_attention_cpu", lambda *a: calls.append(1) or kernel(*a))
    assert_matches(paged_attention(q, *args), paged_attention_reference(q, *args), 1e-5)
    assert len(calls) == (mode == "auto")


@pytest.mark.parametrize(
    ("kv_dtype", "dtype", "static"),
    [
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.float8_e4m3fn, torch.bfloat16, False),
        (torch.float8_e4m3fn, torch.float32, False),
        (torch.float8_e4m3fn, torch.bfloat16, True),
        (torch.int8, torch.bfloat16, False),
        (torch.int8, torch.float32, False),
    ],
)
@pytest.mark.parametrize("window", [None, 5])
def test_a_decode_step_in_one_cpu_call_equals_rotate_write_then_attend(
    monkeypatch, kv_dtype, dtype, static, window
):
    """A decode-only step's attention on the CPU, one kernel call per layer: from q/k/v as the model hands
    them over (views into one fused projection output), or from that output with the rotation inside the
    call. Both leave the cache (scales included) and the output bit for bit as the rotation, the write
    and the attention apart do (INT8: the keys' and queries' Hadamard rotation inside the call too)."""
    import gpu_workers.kernels.decode_step_cpu as cpu
    from gpu_workers.checkpoint import RopeConfig
    from gpu_workers.kernels.rotary import apply_rotary
    from gpu_workers.kv.scales import KVScales
    from gpu_workers.model.attention import PagedAttention
    from gpu_workers.model.rotary import RotaryEmbedding

    monkeypatch.setenv("TESSERA_KERNELS", "auto")
    spec, page_size, heads = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16), 4, 4
    scales = KVScales.from_amax([0.7, 1.3], [2.0, 0.5], tokens=1) if static else None
    tables = [[3, 9, 1, 7], [0, 2, 14], [5, 6, 4, 8, 10], [11], [12, 13]]
    done = [12, 8, 16, 3, 4]  # decode tokens land mid-page, open a page (12, 8, 16, 4) or fill one
    gen = torch.Generator().manual_seed(5)
    caches = [KVCache(spec, 16, page_size, kv_dtype, scales=scales) for _ in range(3)]
    full = AttentionMetadata.build(tables, done, done, page_size)
    kv = [torch.randn(full.num_tokens, 2, 16, generator=gen).to(dtype) for _ in range(2)]
    for cache in caches:
        for layer in range(2):
            cache.write(layer, *kv, full.slot_mapping, full.spans)
    meta = AttentionMetadata.build(tables, [d + 1 for d in done], [1] * len(done), page_size)
    cos, sin = RotaryEmbedding(RopeConfig(), 16)(torch.tensor(done), dtype)
    calls = []
    for name in ("write_and_decode_cpu", "rotate_write_and_decode_cpu"):
        kernel = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a))
    for layer in range(2):
        qkv = (torch.randn(len(done), (heads + 4) * 16, generator=gen) * 3).to(dtype)
        qk = apply_rotary(qkv[:, : (heads + 2) * 16].view(-1, heads + 2, 16), cos, sin)
        q, k = qk.split([heads, 2], dim=1)
        v = qkv[:, (heads + 2) * 16 :].view(-1, 2, 16)
        called = PagedAttention(caches[0], meta)(layer, q, k, v, 0.25, window)
        rotated = PagedAttention(caches[1], meta).rotate_and_attend(
            layer, qkv, cos, sin, heads, 2, 0.25, window
        )
        apart = caches[2]
        apart.write(layer, k, v, meta.slot_mapping, meta.spans)
        queries, scale = apart.queries(q, 0.25)  # INT8 keys are stored rotated, and read by rotated queries
        expected = paged_attention(
            queries, *apart.layer(layer), meta, scale, window, *apart.layer_scales(layer)
        )
        assert called.dtype == rotated.dtype == dtype
        assert torch.equal(called, expected) and torch.equal(rotated, expected)
    assert calls == ["write_and_decode_cpu", "rotate_write_and_decode_cpu"] * 2
    for ours in caches[:2]:
        theirs = caches[2]
        assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)
        if kv_dtype == torch.float8_e4m3fn:
            assert torch.equal(ours.k_scale, theirs.k_scale) and torch.equal(ours.v_scale, theirs.v_scale)


def test_kv_write_bf16_scatters_exactly():
    gen = torch.Generator().manual_seed(0)
    slots = torch.zeros(40, 2, 24, dtype=torch.bfloat16)
    expected = slots.clone()
    mapping = torch.randperm(40, generator=gen)[:9]
    x = torch.randn(9, 2, 24, generator=gen).to(torch.bfloat16)  # already bf16: no rounding involved
    write_kv_triton(x, slots, mapping, None, 4)
    write_kv_reference(x, expected, mapping, None, 4)
    assert torch.equal(slots, expected)


def test_kv_write_fp8_matches_reference_except_the_interpreters_carry_bug():
    gen = torch.Generator().manual_seed(1)
    page_size, pages = 4, 16
    page_scale = torch.exp2(torch.randint(-4, 3, (pages,), generator=gen).float())
    mapping = torch.randperm(pages * page_size, generator=gen)[:20]
    token_scale = page_scale[mapping // page_size][:, None, None]
    grid = torch.randn(20, 2, 32, generator=gen).clamp(-3, 3) * 100
    exact = grid.to(torch.float8_e4m3fn).float() * token_scale  # x / scale is an e4m3 value: no rounding
    randomish = torch.randn(20, 2, 32, generator=gen) * token_scale * 50
    for x, must_be_exact in ((exact, True), (randomish, False)):
        out = torch.zeros(pages * page_size, 2, 32, dtype=torch.uint8)
        ref = out.clone()
        write_kv_triton(x, out, mapping, page_scale, page_size)
        write_kv_reference(x, ref, mapping, page_scale, page_size)
        wrong = out != ref
        if must_be_exact:
            assert not wrong.any()
            continue
        got = out[wrong].view(torch.float8_e4m3fn).float()
        want = ref[wrong].view(torch.float8_e4m3fn).float()
        # Torch rounded up into the next binade (a power of two); the interpreter kept the old exponent
        # with a zero mantissa: exactly half. Anything else would be a kernel bug.
        assert torch.equal(want.abs(), torch.exp2(torch.log2(want.abs()).round()))
        assert torch.equal(got, want / 2)
        assert wrong.float().mean() < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kv_writes_equal_the_torch_path_bit_for_bit(monkeypatch, dtype):
    """INT8 entries written by the Triton kernel (interpreted), the numba write and the torch reference:
    the same codes and scales, for entries of every size (a zero entry, tiny and huge ones)."""
    from gpu_workers.kernels.kv_write_cpu import write_kv_int8_cpu

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(23, 3, 40, generator=gen) * torch.exp2(torch.randint(-30, 20, (23, 3, 1), generator=gen))
    x[5, 1] = 0.0
    x[6, 2, 7] = 3e4  # one outlier: its entry's other values round to few codes, never past ±127
    x = x.to(dtype)
    mapping = torch.randperm(64, generator=gen)[:23]
    written = []
    for write in (
        lambda slots: write_kv_reference(x, slots, mapping, None, 16),
        lambda slots: write_kv_triton(x, slots, mapping, None, 16),
        lambda slots: write_kv_int8_cpu(x, slots, mapping),
    ):
        slots = torch.zeros(64, 3, 42, dtype=torch.int8)
        write(slots)
        written.append(slots)
    assert torch.equal(written[0], written[1]) and torch.equal(written[0], written[2])
    back = dequantize_int8_entries(written[0][mapping], torch.float32)
    codes = written[0][mapping][..., :40].float()
    assert codes.abs().max() == 127 and torch.equal(back[5, 1], torch.zeros(40))
    # Every value within half a code of the entry's own amax / 127 (amax at least MIN_AMAX, 1e-6), the bf16
    # scale's rounding aside (2^-9 relative).
    step = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-6) / 127
    assert ((back - x.float()).abs() <= step * (0.5 + 2**-8)).all()


def test_cpu_fp8_write_equals_the_torch_path_bit_for_bit(monkeypatch):
    """Opening pages (dynamic scales: inherited, raised by a loud chunk), quantising and scattering: the
    numba write leaves the cache, scales included, exactly as the torch path does."""
    from gpu_workers.kv.scales import KVScales

    spec, page_size = KVSpec(num_layers=2, num_kv_heads=2, head_dim=24), 4
    tables = [[3, 9, 1, 7, 12], [0, 2, 15], [5, 6, 4, 8, 10, 11]]
    # Prefill in chunks that start mid-page and span pages, then decode steps that open pages and not.
    steps = [
        ([0, 0, 0], [6, 3, 9]),
        ([6, 3, 9], [5, 4, 2]),
        ([11, 7, 11], [1, 1, 1]),
        ([12, 8, 12], [1, 1, 1]),
    ]
    loud = {2: 40.0}  # step 2's tokens are 40x louder: a page they open takes a larger scale
    gen = torch.Generator().manual_seed(3)
    writes = []
    for i, (done, new) in enumerate(steps):
        meta = AttentionMetadata.build(
            tables, [d + n for d, n in zip(done, new, strict=True)], new, page_size
        )
        x = [torch.randn(meta.num_tokens, 2, 24, generator=gen) * loud.get(i, 1.0) for _ in range(2)]
        x[0][0, 0, 0] = 1e4  # saturates at 448 x scale wherever its page was opened quieter
        writes.append((meta, [t.to(torch.bfloat16) for t in x]))
    static = KVScales.from_amax([0.7, 1.3], [2.0, 0.5], tokens=1)
    for scales in (None, static):
        caches = {}
        for mode in ("reference", "auto"):
            monkeypatch.setenv("TESSERA_KERNELS", mode)
            cache = KVCache(spec, num_pages=16, page_size=page_size, dtype=torch.float8_e4m3fn, scales=scales)
            for layer in range(2):
                for meta, (k, v) in writes:
                    cache.write(layer, k, v, meta.slot_mapping, meta.spans)
                cache.write(layer, k[:2], v[:2], torch.tensor([52, 53]))  # no spans: one sequence
            caches[mode] = cache
        ref, cpu = caches["reference"], caches["auto"]
        assert torch.equal(cpu.k, ref.k) and torch.equal(cpu.v, ref.v)
        assert torch.equal(cpu.k_scale, ref.k_scale) and torch.equal(cpu.v_scale, ref.v_scale)
        if scales is None:  # dynamic scales did differ between pages (static ones are one per layer)
            assert len(set(ref.k_scale[0].tolist())) > 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_kernel_matches_reference(dtype, with_residual):
    """The residual stream's sum and the normalised row: in fp32 the sum exactly and the row to fp32 rounding,
    in bf16 both within one bf16 step (the interpreter truncates its casts); a width that is not a power of
    two."""
    gen = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(5, 40, generator=gen).to(dtype) * 3 for _ in range(2))
    weight = (torch.rand(40, generator=gen) + 0.5).to(dtype)
    residual = residual if with_residual else None
    out, summed = add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_out, ref_summed = add_rms_norm_reference(x, residual, weight, 1e-6)
    if dtype == torch.float32:
        assert torch.equal(summed, ref_summed)
        assert_matches(out, ref_out, 1e-6)
    else:
        assert_matches(summed, ref_summed, 2**-7)
        assert_matches(out, ref_out, 2**-6)  # a step off in the sum moves the row's scale too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_matches_reference(dtype):
    """Rows wider than one block with a ragged last block, gates from deep negative (SiLU ~ 0) to large; a
    strided input (a view) read as it is. fp32 to its rounding; bf16 within one bf16 step of each of the two
    roundings (the interpreter truncates its casts)."""
    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(3, 2 * 1100, generator=gen) * 8).to(dtype)
    assert_matches(
        silu_mul_triton(gate_up), silu_mul_reference(gate_up), 1e-6 if dtype == torch.float32 else 2**-6
    )
    wide = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * 1100]
    assert torch.equal(silu_mul_triton(wide), silu_mul_triton(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dim", [16, 24])  # 24: Hadamard blocks of 8, a padded tile
def test_rotate_write_kv_kernel_matches_reference(dtype, kv, dim):
    """Split, rotary, INT8 keys' and queries' Hadamard rotation and both writes in one launch: in fp32 the
    same queries and cache bytes as the torch path; in bf16 within a few bf16 steps (the interpreter truncates
    each of the rotation's three roundings), INT8 entries then within two codes of each other."""
    from gpu_workers.checkpoint import RopeConfig
    from gpu_workers.formats.kv_int8 import rotation_block
    from gpu_workers.model.rotary import RotaryEmbedding

    heads, kv_heads, tokens = 6, 2, 5
    gen = torch.Generator().manual_seed(8)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(dtype)
    cos, sin = RotaryEmbedding(RopeConfig(), dim)(torch.tensor([0, 3, 17, 40, 200]), dtype)
    mapping = torch.randperm(32, generator=gen)[:tokens]
    slot_dtype, width = (torch.int8, dim + 2) if kv == "int8" else (dtype, dim)
    block = rotation_block(dim) if kv == "int8" else 1
    outs = []
    for rotate_write in (rotate_write_kv_triton, rotate_write_kv_reference):
        k_slots, v_slots = (torch.zeros(32, kv_heads, width, dtype=slot_dtype) for _ in range(2))
        q = rotate_write(qkv, cos, sin, heads, kv_heads, k_slots, v_slots, mapping, block)
        outs.append((q, k_slots, v_slots))
    (q, k, v), (ref_q, ref_k, ref_v) = outs
    if kv == "int8":
        k, v, ref_k, ref_v = (dequantize_int8_entries(x, torch.float32) for x in (k, v, ref_k, ref_v))
    if dtype == torch.float32:
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(v, ref_v)
    else:
        for out, ref in ((q, ref_q), (k, ref_k), (v, ref_v)):
            assert_matches(out, ref, 2**-6 if kv == "model" else 2 / 127)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_int4_engine_on_kernels_generates_the_reference_tokens(
    tiny_llama_dir, tmp_path, monkeypatch, kv_cache_dtype
):
    """The engine on the Triton kernels (interpreted: W4A16 linears, add + RMSNorm, rotary inside the KV
    write, decode attention) and on the torch references agree."""
    quantize_checkpoint(tiny_llama_dir, tmp_path / "int4", "int4", group_size=32)
    config = EngineConfig(dtype="float32", kv_budget_bytes=2**20, page_size=4, kv_cache_dtype=kv_cache_dtype)
    prompts = [[random.Random(s).randrange(2, 120) for _ in range(7 + s)] for s in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    monkeypatch.setenv("TESSERA_KERNELS", "reference")
    reference = [
        o.token_ids for o in Engine.from_pretrained(tmp_path / "int4", config).generate(prompts, params)
    ]
    monkeypatch.setenv("TESSERA_KERNELS", "triton")
    kernels = [
        o.token_ids for o in Engine.from_pretrained(tmp_path / "int4", config).generate(prompts, params)
    ]
    assert kernels == reference

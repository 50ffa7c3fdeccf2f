"""The fast W4A16 kernel (bit-pattern dequantisation, group scales on the accumulator, a weight packed once)
equals the torch reference under Triton's CPU interpreter, on every int4 form the convert kernel takes.

Tolerances as tests/test_kernels.py's int4 tests: 1e-5 of the output's scale for fp32 activations (the same
products summed in another order), 2^-7 for bf16 and fp16 ones (the reference rounds each dequantised
weight to them, the kernel only the output).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import gpu_workers.kernels.int4_linear_triton as int4_triton  # noqa: E402
import gpu_workers.quant.linear as quant_linear_layers  # noqa: E402
from gpu_workers.formats.weights import quantize_int4, unpack_int4  # noqa: E402
from gpu_workers.kernels.int4_linear_triton import int4_linear_fast_triton, int4_tiles  # noqa: E402
from gpu_workers.kernels.int4_pack import prepack_int4_gpu  # noqa: E402
from gpu_workers.kernels.quant_linear import int4_linear_reference  # noqa: E402
from gpu_workers.quant.linear import Int4Linear  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-7}


def assert_matches(out: torch.Tensor, ref: torch.Tensor, relative: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=0, atol=relative * ref.float().abs().max().item()
    )


def gguf_q4_1(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """GGUF's Q4_1 form of a random weight: codes, float16 scales and minimums (W = q * scale + min)."""
    q = quantize_int4(torch.randn(n, k, generator=gen), group)
    scale = q.weight_scale.to(torch.float16)
    minimum = (-q.weight_zero.float() * q.weight_scale.float()).to(torch.float16)
    return q.weight_packed, scale, minimum


# (batch, out features, in features, group size): a decode GEMV; a batch and outputs that are no tile
# multiple with a ragged last group (200 = 3 * 64 + 8); a prefill-sized batch; groups of 16 and 48 (K steps
# of 16); one group wider than the input.
SHAPES = [
    (1, 96, 256, 128),
    (5, 40, 200, 64),
    (37, 72, 160, 32),
    (3, 24, 96, 16),
    (2, 40, 144, 48),
    (4, 32, 64, 128),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES)
def test_fast_int4_gemm_matches_the_reference(m, n, k, group, symmetric, dtype):
    gen = torch.Generator().manual_seed(m + k)
    q = quantize_int4(torch.randn(n, k, generator=gen), group, symmetric)
    x = torch.randn(2, m, k, generator=gen).to(dtype)  # leading dims flatten
    bias = torch.randn(n, generator=gen).to(dtype)
    args = (q.weight_packed, q.weight_scale, q.weight_zero, group)
    out = int4_linear_fast_triton(x, *args, bias)
    assert_matches(out, int4_linear_reference(x, *args, bias), TOLERANCE[dtype])


@pytest.mark.parametrize("split_k", [1, 3])
def test_fast_int4_gemm_sums_every_split_of_k_and_adds_the_bias_once(split_k):
    m, n, k, group = 5, 40, 200, 64
    gen = torch.Generator().manual_seed(split_k)
    q = quantize_int4(torch.randn(n, k, generator=gen), group)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    args = (q.weight_packed, q.weight_scale, q.weight_zero, group)
    pack = prepack_int4_gpu(*args)
    tiles = replace(int4_tiles(m, n, k, group, x.device), block_k=pack.block_k, split_k=split_k)
    out = int4_linear_fast_triton(x, *args, bias, tiles=tiles, pack=pack)
    assert_matches(out, int4_linear_reference(x, *args, bias), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 96, 256, 32), (37, 72, 160, 32)])
def test_fast_int4_gemm_with_gguf_minimums_matches_the_reference(m, n, k, group, dtype):
    gen = torch.Generator().manual_seed(m)
    packed, scale, minimum = gguf_q4_1(n, k, group, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    args = (packed, scale, None, group)
    expected = int4_linear_reference(x, *args, None, minimum)
    assert_matches(int4_linear_fast_triton(x, *args, weight_min=minimum), expected, TOLERANCE[dtype])


@pytest.mark.parametrize(("n", "k", "group"), [(40, 200, 64), (24, 96, 16), (8, 256, 128)])
def test_gpu_pack_lays_out_each_k_step_contiguously_and_unpacks_to_the_codes(n, k, group):
    gen = torch.Generator().manual_seed(k)
    q = quantize_int4(torch.randn(n, k, generator=gen), group)
    pack = prepack_int4_gpu(q.weight_packed, q.weight_scale, q.weight_zero, group)
    codes = unpack_int4(q.weight_packed).long()
    steps = -(-k // pack.block_k)
    assert pack.block_k == min(group, 128) and pack.words.dtype == torch.int32
    assert pack.words.shape == (steps, n, pack.block_k // 8)
    # Nibble p of word j of step s in row r is input s * block_k + 8j + p (code 0 past the input).
    words = pack.words.long() & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * p)) & 0xF for p in range(8)], dim=-1)
    laid_out = nibbles.reshape(steps, n, pack.block_k).transpose(0, 1).reshape(n, steps * pack.block_k)
    assert torch.equal(laid_out[:, :k], codes) and not laid_out[:, k:].any()
    assert torch.equal(pack.weight_packed(), q.weight_packed)
    assert torch.equal(pack.scale, q.weight_scale.t()) and torch.equal(pack.offset, q.weight_zero.t())
    assert pack.nbytes == steps * n * pack.block_k // 2 + 2 * q.weight_scale.nbytes


def test_gpu_pack_of_minimums_keeps_them_and_their_dtype():
    packed, scale, minimum = gguf_q4_1(16, 64, 32, torch.Generator().manual_seed(0))
    pack = prepack_int4_gpu(packed, scale, None, 32, minimum)
    assert pack.has_min and pack.offset.dtype == torch.float16 and torch.equal(pack.offset, minimum.t())
    assert torch.equal(pack.weight_packed(), packed)


def test_fast_kernel_refuses_tiles_whose_k_step_is_not_the_packs():
    q = quantize_int4(torch.randn(16, 128), 128)
    args = (q.weight_packed, q.weight_scale, q.weight_zero, 128)
    tiles = replace(int4_tiles(1, 16, 128, 128, torch.device("cpu")), block_k=64)
    with pytest.raises(ValueError, match="K step 128"):
        int4_linear_fast_triton(torch.randn(1, 128), *args, tiles=tiles)


def triton_layer(monkeypatch, dtype: torch.dtype, minimums: bool = False) -> Int4Linear:
    """A 48 x 200 int4 layer (groups of 64, a ragged last one) computing in ``dtype``, run on the Triton
    kernels, the fast one."""
    monkeypatch.setenv("TESSERA_KERNELS", "triton")
    monkeypatch.setenv("TESSERA_INT4_KERNEL", "fast")
    gen = torch.Generator().manual_seed(7)
    if minimums:
        layer = Int4Linear(200, 48, True, dtype, 64, False, True, torch.float16)
        packed, scale, minimum = gguf_q4_1(48, 200, 64, gen)
        layer.weight_packed.copy_(packed)
        layer.weight_scale.copy_(scale)
        layer.weight_min.copy_(minimum)
    else:
        layer = Int4Linear(200, 48, True, dtype, 64, False)
        layer.load_dense(torch.randn(48, 200, generator=gen))
    layer.bias.data.copy_(torch.randn(48, generator=gen).to(dtype))
    return layer


def layer_reference(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    args = (layer.weight_packed, layer.weight_scale, layer.weight_zero, layer.group_size, layer.bias)
    return int4_linear_reference(x, *args, layer.weight_min)


@pytest.mark.parametrize("minimums", [False, True])
def test_int4_layer_packs_once_and_runs_the_fast_kernel_on_the_pack(monkeypatch, minimums):
    layer = triton_layer(monkeypatch, torch.bfloat16, minimums)
    packs = []

    def counted(*args):
        packs.append(prepack_int4_gpu(*args))
        return packs[-1]

    def convert_kernel(*args, **kwargs):
        raise AssertionError("the layer ran the convert kernel")

    monkeypatch.setattr(quant_linear_layers, "prepack_int4_gpu", counted)
    monkeypatch.setattr(int4_triton, "int4_linear_triton", convert_kernel)
    x = torch.randn(3, 200, dtype=torch.bfloat16)
    for _ in range(2):
        assert_matches(layer(x), layer_reference(layer, x), 2**-7)
    assert len(packs) == 1 and layer.gpu_pack() is packs[0]
    # A reloaded scale (in place, as load_state_dict writes it) is packed again, and used.
    layer.load_state_dict({**layer.state_dict(), "weight_scale": layer.weight_scale * 2})
    assert_matches(layer(x), layer_reference(layer, x), 2**-7)
    assert len(packs) == 2 and torch.equal(packs[1].scale, layer.weight_scale.t())


def test_int4_layer_on_the_convert_kernel_packs_nothing(monkeypatch):
    layer = triton_layer(monkeypatch, torch.float32)
    monkeypatch.setenv("TESSERA_INT4_KERNEL", "convert")
    x = torch.randn(3, 200)
    assert_matches(layer(x), layer_reference(layer, x), 1e-5)
    assert layer._gpu_pack._key is None
    monkeypatch.setenv("TESSERA_INT4_KERNEL", "marlin")
    with pytest.raises(ValueError, match="convert, fast"):
        layer(x)

"""The CPU SiLU x up kernel gives torch's bits (SiLU's exp reproduced to the bit), serves the gated MLPs on the
CPU kernels, and steps aside where it would not give them."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.kernels import silu_mul as dispatch
from gpu_workers.kernels.silu_mul import silu_mul, silu_mul_reference
from gpu_workers.kernels.silu_mul_cpu import cpu_silu_mul_supported, probe, silu_mul_cpu


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_bf16_gate_and_a_float32_spread_give_torchs_bits(dtype):
    """The probe row: every bf16 value as a gate (float32: 2^-140 to 2^7, both signs, zeros, infinities,
    NaN), where a C-library exp or a missing FMA rounds differently on some."""
    gate_up = probe(dtype)
    want, got = silu_mul_reference(gate_up), silu_mul_cpu(gate_up)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    differ = (_bits(want) != _bits(got)) & ~nan
    assert not differ.any(), f"{int(differ.sum())} values differ, first at gate {gate_up[0, differ[0]][:4]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("inter", [64, 1536, 8192])
def test_rows_of_a_gated_mlp_equal_the_reference(dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(dtype)
    assert cpu_silu_mul_supported(gate_up)
    assert torch.equal(silu_mul_cpu(gate_up), silu_mul_reference(gate_up))


def test_rows_torch_ends_with_scalar_work_are_the_references(monkeypatch):
    """A row whose width is no multiple of 64 ends with the C library's exp in torch: not the kernel's."""
    monkeypatch.setenv("TESSERA_KERNELS", "auto")
    calls = []
    real = dispatch._import_cpu().silu_mul_cpu
    assert dispatch.cpu_matches(torch.bfloat16)  # the probe's own call made before counting
    monkeypatch.setattr(dispatch._cpu, "silu_mul_cpu", lambda x: calls.append(x) or real(x))
    odd = torch.randn(3, 2 * 100).to(torch.bfloat16)
    assert not cpu_silu_mul_supported(odd)
    assert torch.equal(silu_mul(odd), silu_mul_reference(odd)) and not calls
    even = torch.randn(3, 2 * 128).to(torch.bfloat16)
    assert torch.equal(silu_mul(even), silu_mul_reference(even)) and len(calls) == 1
    monkeypatch.setenv("TESSERA_KERNELS", "reference")
    assert torch.equal(silu_mul(even), silu_mul_reference(even)) and len(calls) == 1


def test_a_kernel_that_differs_from_this_torch_is_not_used(monkeypatch):
    """The once-per-dtype check against torch is what keeps the kernel out where its arithmetic is not
    torch's: a kernel one ulp off on one probe value fails it, and the reference serves."""
    monkeypatch.setenv("TESSERA_KERNELS", "auto")
    cpu = dispatch._import_cpu()
    real = cpu.silu_mul_cpu

    def off_by_one_ulp(gate_up):
        out = real(gate_up)
        out.view(torch.int16)[0, 12345] += 1
        return out

    dispatch.cpu_matches.cache_clear()
    monkeypatch.setattr(cpu, "silu_mul_cpu", off_by_one_ulp)
    try:
        assert not dispatch.cpu_matches(torch.bfloat16)
        gate_up = torch.randn(1, 2 * 64 * 200).to(torch.bfloat16)
        assert torch.equal(silu_mul(gate_up), silu_mul_reference(gate_up))
    finally:
        dispatch.cpu_matches.cache_clear()
    monkeypatch.setattr(cpu, "silu_mul_cpu", real)
    assert dispatch.cpu_matches(torch.bfloat16)

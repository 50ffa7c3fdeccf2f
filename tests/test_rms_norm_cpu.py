"""The CPU add + RMSNorm kernel gives the torch reference's bits (and so HF's LlamaRMSNorm's), and serves the
decoder layers' norms on the CPU kernels."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.kernels.rms_norm import add_rms_norm, add_rms_norm_reference
from gpu_workers.kernels.rms_norm_cpu import add_rms_norm_cpu, cpu_norm_supported


def _rows(rows: int, dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different scales: a sum in another order would round differently on some of them.
    x = (torch.randn(rows, dim, generator=gen) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
    residual = (torch.randn(rows, dim, generator=gen) * 4).to(dtype)
    weight = torch.randn(dim, generator=gen).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [3, 7, 8, 64, 100, 576, 2048, 4096, 5120, 16384])
def test_the_cpu_norm_gives_the_reference_bits(dtype, dim):
    """Lengths below one vector, between vectors, and long enough for the sum's cascade of levels; with and
    without the residual add; one row (decode) and many (prefill)."""
    for rows in (1, 200):
        x, residual, weight = _rows(rows, dim, dtype, seed=dim + rows)
        for res in (None, residual):
            want_normed, want_summed = add_rms_norm_reference(x, res, weight, 1e-5)
            normed, summed = add_rms_norm_cpu(x, res, weight, 1e-5)
            assert normed.dtype == dtype and summed.dtype == dtype
            assert torch.equal(summed, want_summed)
            assert torch.equal(normed, want_normed), f"{(normed != want_normed).sum()} values differ"


def test_the_cpu_norm_equals_hf_after_the_add():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual, weight = _rows(64, 576, torch.bfloat16, seed=3)
    theirs = LlamaRMSNorm(576, eps=1e-6).to(torch.bfloat16)
    theirs.weight.data.copy_(weight)
    normed, summed = add_rms_norm_cpu(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, theirs(x + residual))


def test_the_cpu_norm_reads_strided_rows_and_leaves_its_inputs():
    x, residual, weight = _rows(8, 256, torch.bfloat16, seed=5)
    wide = torch.cat([x, x], dim=1)[:, :256]  # not contiguous
    before = wide.clone(), residual.clone()
    normed, _ = add_rms_norm_cpu(wide, residual, weight, 1e-5)
    assert torch.equal(normed, add_rms_norm_reference(x, residual, weight, 1e-5)[0])
    assert torch.equal(wide, before[0]) and torch.equal(residual, before[1])


def test_decoder_norms_take_the_cpu_kernel_only_on_the_cpu_kernels(monkeypatch):
    x, residual, weight = _rows(2, 64, torch.bfloat16, seed=7)
    calls = []
    import gpu_workers.kernels.rms_norm_cpu as cpu

    real = cpu.add_rms_norm_cpu
    monkeypatch.setattr(cpu, "add_rms_norm_cpu", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setenv("TESSERA_KERNELS", "auto")
    add_rms_norm(x, residual, weight, 1e-5)
    assert len(calls) == 1
    monkeypatch.setenv("TESSERA_KERNELS", "reference")
    assert torch.equal(add_rms_norm(x, residual, weight, 1e-5)[0], real(x, residual, weight, 1e-5)[0])
    assert len(calls) == 1
    # What the kernel cannot read by address is the reference's: other dtypes, a broadcast residual.
    assert cpu_norm_supported(x, residual, weight) and cpu_norm_supported(x, None, weight)
    assert not cpu_norm_supported(x, residual, weight.float())
    assert not cpu_norm_supported(x.float(), residual, weight.float())
    assert not cpu_norm_supported(x, residual[:1], weight)
    assert not cpu_norm_supported(x, residual, weight[:32])
    monkeypatch.setenv("TESSERA_KERNELS", "auto")
    broadcast = add_rms_norm(x, residual[:1], weight, 1e-5)
    assert torch.equal(broadcast[0], add_rms_norm_reference(x, residual[:1], weight, 1e-5)[0])
    assert len(calls) == 1

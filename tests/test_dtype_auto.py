"""dtype="auto": bf16 on CUDA and where a CPU multiplies bf16 fast, else fp32 with weights upcast at load."""

from __future__ import annotations

import logging

import pytest
import torch

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.engine.dtype import BF16_TOLERANCE, cpu_bf16_slowdown, cpu_dtype, resolve_dtype
from gpu_workers.pools.worker import engine_config
from gpu_workers.protocol import DeploymentSpec


def test_auto_is_the_default_of_engines_and_deployments():
    from tessera.deployments import DeploymentConfig

    assert EngineConfig().dtype == "auto"
    assert DeploymentSpec(name="m", checkpoint="/c").dtype == "auto"
    assert DeploymentConfig(name="m", checkpoint="/c").dtype == "auto"
    assert engine_config(DeploymentSpec(name="m", checkpoint="/c"), "decode", b"s").dtype == "auto"


def test_auto_on_x86_follows_the_bf16_flags_and_never_a_timing():
    def timing():
        raise AssertionError("an x86 CPU's flags decide; a timing depends on the load of the moment")

    x86 = {"architecture": "x86_64", "avx512_bf16": False, "amx_bf16": False}
    assert cpu_dtype(x86, timing).name == "float32"
    assert cpu_dtype({**x86, "avx512_bf16": True}, timing).name == "bfloat16"
    assert cpu_dtype({**x86, "amx_bf16": True}, timing).name == "bfloat16"
    assert "amx_bf16" in cpu_dtype({**x86, "amx_bf16": True}, timing).reason


def test_auto_elsewhere_follows_the_measured_bf16_speed():
    arm = {"architecture": "aarch64"}
    assert cpu_dtype(arm, lambda: BF16_TOLERANCE * 0.5).name == "bfloat16"
    slow = cpu_dtype(arm, lambda: BF16_TOLERANCE * 4)
    assert slow.name == "float32" and "bf16 matmul takes 5.0x" in slow.reason


def test_auto_on_this_cpu_is_what_its_capabilities_say():
    capabilities = torch.cpu.get_capabilities()
    assert resolve_dtype("auto", "cpu") == cpu_dtype(capabilities, cpu_bf16_slowdown)
    if capabilities.get("architecture") == "x86_64":
        fast = capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")
        assert resolve_dtype("auto", "cpu").name == ("bfloat16" if fast else "float32")


def test_auto_on_cuda_is_bf16_and_an_explicit_dtype_is_kept():
    assert resolve_dtype("auto", "cuda").name == "bfloat16"
    assert resolve_dtype("float16", "cpu").name == "float16"
    assert EngineConfig(dtype="bfloat16").torch_dtype == torch.bfloat16


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto', 'bfloat16'"):
        EngineConfig(dtype="int8")


def test_auto_engine_loads_weights_in_the_chosen_dtype_and_reports_it(demo_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="gpu_workers.engine.engine"):
        engine = Engine.from_pretrained(demo_model_dir, EngineConfig(kv_budget_bytes=4 * 2**20))
    chosen = resolve_dtype("auto", "cpu")
    stats = engine.stats()
    assert stats["dtype"] == chosen.name and stats["dtype_reason"] == chosen.reason
    assert all(p.dtype == chosen.torch_dtype for p in engine.model.parameters() if p.is_floating_point())
    assert engine.cache.k.dtype == chosen.torch_dtype  # KV "auto" follows the compute dtype
    assert f"engine computes in {chosen.name}" in caplog.text
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4

"""Training reaches every weight: the layers' norms and activation run the torch references under autograd
(the CPU and Triton kernels record no gradient), whatever kernels the machine has."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.kernels import backend
from gpu_workers.tools.train.model import build_model, hf_config, loss_fn


@pytest.mark.parametrize("mode", ["auto", "reference"])
def test_a_training_step_gives_every_parameter_a_gradient(monkeypatch, mode):
    monkeypatch.setenv("TESSERA_KERNELS", mode)
    config = hf_config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        context=32,
    )
    model = build_model(config, seed=0)
    rows = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    loss_fn(model, rows[:, :-1], rows[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reached {missing} (kernels: {backend(torch.device('cpu'))})"

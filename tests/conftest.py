"""Shared fixtures: tiny checkpoints built at test time (HF transformers writes them, we load them)."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist, N test processes share the cores: each computes on cores // N threads (torch's here,
    OMP_NUM_THREADS for the processes its tests start), as `tessera up` divides them among its workers. With
    every process on every core, OpenMP threads spin waiting for each other: the SmolLM2 engines of
    test_openai_sdk.py took 28 s for 24 greedy tokens on two threads beside other work, 1.4 s on one.

    xdist 3.8+ would also re-sort the test files by how many tests they hold, undoing SLOWEST_FILES' order: it
    is told not to, as ``--no-loadscope-reorder`` would (older versions keep the collection's order)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if processes > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // processes)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


# The suite's slowest files, longest first (seconds, each alone in one xdist process on the 2-core VM,
# 2026-12-06): they start first, so that CI's two processes end together instead of one running a long file
# alone at the end (xdist's own order sends the files holding the most tests first, and these hold few). The
# other files follow in their own order.
SLOWEST_FILES = (
    "test_bench_matrix.py",  # 300
    "test_launcher.py",  # 170
    "test_kernels.py",  # 160, numba compiling on a fresh clone
    "test_tools.py",  # 90
    "test_config_reload.py",  # 77
    "test_openai_sdk.py",  # 66
    "test_wheel.py",  # 58
    "test_bench_serve.py",  # 45
    "test_web_ui.py",  # 44
    "test_soak.py",  # 43
    "test_bench_serving.py",  # 43
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    # A stable sort: each file's tests keep their order, and the other files theirs.
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random fp32 Llama checkpoint (GQA, no tokenizer files), written by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=127,
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Random init leaves logits nearly flat; a larger output scale makes greedy picks decisive.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The demo checkpoint `tessera init-model` writes: random Llama weights plus a real BPE tokenizer."""
    from gpu_workers.tools.demo_checkpoint import write_demo_checkpoint

    path = tmp_path_factory.mktemp("demo-model")
    write_demo_checkpoint(path, seed=0)
    return path


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test: on a small shared machine, OpenMP threads stall each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

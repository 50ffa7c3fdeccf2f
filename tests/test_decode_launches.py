"""How many kernels one decode step launches on the CUDA code path, counted on the CPU.

On a GPU a small model's decode step is bound by the host issuing launches (BENCHMARKS.md: on the H200 a 1B
Llama's step kept the GPU 14% busy, ~45 launches a layer). Here the step runs the GPU's code path with the
Triton kernels in Triton's interpreter (``TESSERA_KERNELS=triton``) and counts what a GPU would launch: each
torch op that computes (writes a tensor in place, or returns one that is not a view of its inputs; views and
allocations launch nothing), through a ``TorchDispatchMode``, and each Triton kernel, through the
interpreter's entry point (the torch ops the interpreter itself runs to emulate a kernel are not counted).
The counts are held exactly: a change that adds a launch per layer must change the number here, deliberately.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from gpu_workers.checkpoint import ModelConfig  # noqa: E402
from gpu_workers.kv import AttentionMetadata, KVCache  # noqa: E402
from gpu_workers.model.attention import PagedAttention  # noqa: E402
from gpu_workers.model.llama import LlamaForCausalLM  # noqa: E402

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class Launches(TorchDispatchMode):
    """Records each launch as (where, name): torch ops that compute, and Triton kernels (``triton``)."""

    def __init__(self):
        super().__init__()
        self.launches: list[tuple[str, str]] = []
        self.where = "step"
        self.in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        computes = func.__name__.split(".")[0] not in ALLOCATIONS and bool(
            _storages(out) - _storages((args, kwargs))
        )
        if not self.in_kernel and (writes or computes):
            self.launches.append((self.where, str(func)))
        return out

    def kernel(self, run):
        def counted(fn, *args, **kwargs):
            self.launches.append((self.where, f"triton.{fn.fn.__name__}"))
            self.in_kernel += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self.in_kernel -= 1

        return counted


def decode_step_launches(monkeypatch, kv_dtype: torch.dtype) -> tuple[list[str], int]:
    """One decode step of two rows through a 3-layer bf16 Llama (fused projections, as served): the middle
    layer's launches and the step's total, logits included."""
    monkeypatch.setenv("TESSERA_KERNELS", "triton")
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.fuse_projections()
    cache = KVCache(model.kv_spec, num_pages=16, page_size=4, dtype=kv_dtype)
    meta = AttentionMetadata.build([[0, 1], [2, 3, 4]], [6, 11], [1, 1], page_size=4)
    counter = Launches()
    monkeypatch.setattr(InterpretedFunction, "run", counter.kernel(InterpretedFunction.run))
    layer = model.model.layers[1]
    layer_forward = layer.forward  # the stack calls each layer's forward (no module call, no hooks)

    def counted_layer(*args):
        counter.where = "layer"
        try:
            return layer_forward(*args)
        finally:
            counter.where = "step"

    monkeypatch.setattr(layer, "forward", counted_layer)
    ids, positions = torch.tensor([5, 7]), torch.tensor([5, 10])  # on a GPU: the step's input copies
    with torch.inference_mode(), counter:
        hidden = model(ids, positions, PagedAttention(cache, meta))
        model.compute_logits(hidden)
    return [name for where, name in counter.launches if where == "layer"], len(counter.launches)


# A decoder layer: add + RMSNorm, q/k/v matmul, rotary + K/V write, attention (split, merge), o matmul,
# add + RMSNorm, gate/up matmul, SiLU x up, down matmul. Before the fused kernels: 36 (BF16 KV) and 60
# (INT8 KV: the Hadamard butterflies of keys and queries as torch ops); 11 with SiLU and the multiply apart.
LAYER = [
    "triton._add_rms_norm_kernel",
    "aten.linear.default",
    "triton._rotate_write_kernel",
    "triton._decode_split_kernel",
    "triton._merge_splits_kernel",
    "aten.linear.default",
    "triton._add_rms_norm_kernel",
    "aten.linear.default",
    "triton._silu_mul_kernel",
    "aten.linear.default",
]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_a_decode_layer_launches_ten_kernels(monkeypatch, kv_dtype):
    layer, step = decode_step_launches(monkeypatch, kv_dtype)
    assert layer == LAYER
    # Three layers, plus the embedding, the rotary tables (7), the last add + norm, the logits and their cast
    # to fp32. Before the fused kernels: 126 (BF16 KV), 198 (INT8 KV).
    assert step == 3 * len(LAYER) + 11

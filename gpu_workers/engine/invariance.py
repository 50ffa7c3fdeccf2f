"""Batch-invariant execution: a request's numbers do not depend on what else shares its steps.

A deployment opts in (``EngineConfig.batch_invariant``) when a fixed seed must give the same answer whether
a request runs alone or among others, streamed or not. Two things otherwise vary with the batch: a GEMM's
kernel and how it splits the work, chosen by the number of rows (``PaddedLinears`` runs every linear in
blocks of exactly ``MIN_ROWS`` rows, the last padded), and where a
prompt's prefill is cut into chunks (the scheduler cuts at multiples of ``chunk_tokens`` and takes a
prefix-cache hit only up to one). Not covered: a preempted sequence is recomputed with its generated tokens
as prompt chunks, which may move its later tokens, so such a deployment wants KV for its ``max_num_seqs``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Every row of a linear is computed in a call of exactly this many rows. MKL's fp32 GEMM rounds a call of
# 1-15 rows otherwise than one of 16+, and with more than one thread it splits the sum over K for some row
# counts (measured on an AVX-512 Xeon, 2 threads: a 576 x 1536 layer from 58 rows on, 4096 x 4096 from 513);
# on a CPU with AMX, torch's int4 kernel also computes a row differently by the call's row count. One row
# count for every call keeps a row's bits; the row's place in its block does not move them.
MIN_ROWS = 16
MAX_CHUNK_TOKENS = 256


def _row_ops() -> tuple:
    """The products the engine computes a layer's rows with, each taking its rows [..., in] first and
    returning [..., out]: ``F.linear``, torch's CPU int4 kernel and oneDNN's packed linear."""
    ops = [F.linear, torch.ops.aten._weight_int4pack_mm_for_cpu.default]
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        ops.append(torch.ops.mkldnn._linear_pointwise.default)
    return tuple(ops)


class PaddedLinears(TorchFunctionMode):
    """While active, every product of a layer's rows (``_row_ops``: ``F.linear``, the CPU int4 kernel, the
    packed bf16 linear) runs as calls of exactly ``MIN_ROWS`` rows: its rows in blocks of that many, the last
    block padded with zero rows, and returns the rows asked for."""

    def __init__(self):
        super().__init__()
        self._ops = _row_ops()

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func in self._ops or getattr(func, "default", None) in self._ops:
            x = args[0]
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            if rows > 0 and rows != MIN_ROWS:
                flat = x.reshape(rows, x.shape[-1])
                padding = -rows % MIN_ROWS
                if padding:
                    flat = torch.cat([flat, flat.new_zeros(padding, flat.shape[1])])
                out = torch.cat([func(block, *args[1:], **kwargs) for block in flat.split(MIN_ROWS)])[:rows]
                return out.reshape(*x.shape[:-1], out.shape[-1])
        return func(*args, **kwargs)


def chunk_tokens(page_size: int, max_num_batched_tokens: int) -> int:
    """The fixed prefill chunk: whole pages (so a prefix-cache hit can end on a chunk boundary), at most
    half the step's token budget (so a chunk always fits beside the decoding rows) and ``MAX_CHUNK_TOKENS``."""
    limit = min(MAX_CHUNK_TOKENS, max_num_batched_tokens // 2)
    return page_size * max(1, limit // page_size)

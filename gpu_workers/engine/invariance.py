"""Batch-invariant execution: a request's numbers do not depend on what else shares its steps.

A deployment opts in (``EngineConfig.batch_invariant``) when a fixed seed must give the same answer whether
a request runs alone or among others, streamed or not. Two things otherwise vary with the batch: a GEMM's
kernel, chosen by the number of rows (``PaddedLinears`` pads every linear to ``MIN_ROWS`` rows), and where a
prompt's prefill is cut into chunks (the scheduler cuts at multiples of ``chunk_tokens`` and takes a
prefix-cache hit only up to one). Not covered: a preempted sequence is recomputed with its generated tokens
as prompt chunks, which may move its later tokens, so such a deployment wants KV for its ``max_num_seqs``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# A GEMM of at least this many rows computes each row the same way whatever their number, on the CPU GEMMs
# the engine calls (MKL fp32, oneDNN bf16, torch's int4 kernel); fewer rows take other kernels.
MIN_ROWS = 16
MAX_CHUNK_TOKENS = 256


class PaddedLinears(TorchFunctionMode):
    """While active, every ``F.linear`` of fewer than ``MIN_ROWS`` rows runs padded with zero rows to
    ``MIN_ROWS`` and returns the rows asked for."""

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0]
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            if 0 < rows < MIN_ROWS:
                flat = x.reshape(rows, x.shape[-1])
                padded = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
                out = func(padded, *args[1:], **kwargs)[:rows]
                return out.reshape(*x.shape[:-1], out.shape[-1])
        return func(*args, **kwargs)


def chunk_tokens(page_size: int, max_num_batched_tokens: int) -> int:
    """The fixed prefill chunk: whole pages (so a prefix-cache hit can end on a chunk boundary), at most
    half the step's token budget (so a chunk always fits beside the decoding rows) and ``MAX_CHUNK_TOKENS``."""
    limit = min(MAX_CHUNK_TOKENS, max_num_batched_tokens // 2)
    return page_size * max(1, limit // page_size)

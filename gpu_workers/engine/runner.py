"""Owns the model and the KV tensors; turns a scheduled batch into next-token logits. Also the engine's
model loading and KV allocation, and the single-sequence paged forward the offline tools share."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_workers.engine.graphs import DecodeGraphs
from gpu_workers.engine.invariance import PaddedLinears
from gpu_workers.engine.params import EngineConfig
from gpu_workers.engine.scheduler import ScheduledBatch
from gpu_workers.kernels import one_mode
from gpu_workers.kernels.packed_linear import pack_linears
from gpu_workers.kv import AttentionMetadata, KVCache, KVSpec
from gpu_workers.model.attention import PagedAttention

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        device: str,
        graphs: DecodeGraphs | None = None,
        batch_invariant: bool = False,
    ):
        self.model = model
        self.cache = cache
        self.device = device
        self.graphs = graphs  # decode steps from CUDA graphs (EngineConfig.cuda_graphs)
        self.batch_invariant = batch_invariant  # linears padded to MIN_ROWS (engine/invariance.py)

    def run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        """Compute the batch's new tokens; return the rows that reached their last token and their logits
        (float32, on the device: the sampler runs there and copies back only what it picked).

        A row whose prompt chunk stops short of the end produces no logits this step.
        """
        if not self.batch_invariant:
            return self._run(batch)
        with PaddedLinears():
            return self._run(batch)

    @torch.inference_mode()
    def _run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        if self.graphs is not None and self.graphs.serves(batch):
            return self.graphs.run(batch)
        input_ids: list[int] = []
        positions: list[int] = []
        context_lens: list[int] = []
        last_rows: list[int] = []  # index into the batch of sequences that sample this step
        last_tokens: list[int] = []  # flat token index of their final token
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed
            input_ids.extend(seq.tokens(start, start + n))
            positions.extend(range(start, start + n))
            context_lens.append(start + n)
            if start + n == seq.num_tokens:
                last_rows.append(row)
                last_tokens.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(
            [seq.table.pages for seq in batch.seqs],
            context_lens,
            batch.num_new_tokens,
            self.cache.page_size,
            self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with one_mode():  # TESSERA_KERNELS read once for the step's every kernel choice
            # A batch-invariant step attends by one path whatever else shares it (model/attention.py).
            hidden = self.model(ids, pos, PagedAttention(self.cache, meta, one_call=not self.batch_invariant))
            if not last_rows:
                return [], hidden.new_empty((0, 0), dtype=torch.float32)
            if len(last_tokens) < len(input_ids):  # else every token is its row's last: hidden as it is
                hidden = hidden[torch.tensor(last_tokens, device=self.device)]
            logits = self.model.compute_logits(hidden)
        return last_rows, logits.float()


def load_for_serving(path: str | Path, config: EngineConfig, progress: bool = False) -> torch.nn.Module:
    """A checkpoint's model as the engine serves it: projections fused; on the CPU, linears packed for
    oneDNN and a tied output projection given its own packed copy of the embedding."""
    from gpu_workers.model import load_model

    model = load_model(
        path, dtype=config.torch_dtype, device=config.device, progress=progress, weights=config.weights
    )
    model.fuse_projections()
    if config.device == "cpu":
        pack_linears(model)
        if model.pack_tied_output():
            weight = model.model.embed_tokens.weight
            log.info(
                "the tied output projection runs on a packed copy of the embedding (%.1f MiB more)",
                weight.numel() * weight.element_size() / 2**20,
            )
    return model


def build_cache(spec: KVSpec, config: EngineConfig) -> tuple[KVCache, int]:
    """The engine's KV tensors in ``config.kv_budget_bytes``, and how many of their pages sequences may use."""
    num_pages = KVCache.pages_for_budget(spec, config.kv_budget_bytes, config.page_size, config.kv_dtype)
    if num_pages < 1:
        page_bytes = KVCache.page_bytes(spec, config.page_size, config.kv_dtype)
        raise ValueError(
            f"kv_budget_bytes={config.kv_budget_bytes} holds no KV page: one page of {config.page_size} "
            f"tokens takes {page_bytes} bytes for this model; raise the budget or lower page_size"
        )
    cache = KVCache(spec, num_pages, config.page_size, config.kv_dtype, config.device, config.kv_scales)
    # The last page may be kept aside as a scratch page, never handed to a sequence: CUDA graphs' padded
    # rows write there, and with it FP8 pages with dynamic scales open without a masked write, which on a
    # GPU reads the mask's count back to the host (a sync per layer and tensor, every step).
    if config.cuda_graphs or (cache.opens_pages and torch.device(config.device).type == "cuda"):
        if num_pages < 2:
            raise ValueError(
                f"kv_budget_bytes={config.kv_budget_bytes} holds one KV page; this engine keeps one aside "
                "(CUDA graphs' padded rows, FP8 pages opened without a host sync): raise the budget"
            )
        num_pages -= 1
        cache.scratch_page = num_pages
    return cache, num_pages


def sequence_cache(model: torch.nn.Module, num_tokens: int, page_size: int = 16) -> tuple[KVCache, list[int]]:
    """A private cache in the model's dtype with pages for one sequence of ``num_tokens``, and its table."""
    param = next(p for p in model.parameters() if p.is_floating_point())
    num_pages = -(-num_tokens // page_size)
    return KVCache(model.kv_spec, num_pages, page_size, param.dtype, param.device), list(range(num_pages))


@torch.inference_mode()
def forward_sequence(
    model: torch.nn.Module,
    cache: KVCache,
    pages: list[int],
    token_ids: list[int],
    chunk_size: int | None = None,
    wrap: Callable[[PagedAttention], Callable] | None = None,
) -> torch.Tensor:
    """Final hidden states [len(token_ids), hidden] of one sequence prefilled from position 0 into ``pages``.

    The one paged forward behind calibration, the quantisation quality check and the eval scorer: every
    attention read, including a chunk's own tokens, goes through ``cache`` in its KV format, exactly as
    when serving. Chunks of ``chunk_size`` tokens (the whole sequence when None) make later chunks read
    the cache; ``wrap`` wraps each chunk's attention (scripts/kv_error_sources.py records and transforms
    K/V with it).
    """
    device = cache.k.device
    step = chunk_size or len(token_ids)
    hidden = []
    for start in range(0, len(token_ids), step):
        end = min(start + step, len(token_ids))
        meta = AttentionMetadata.build([pages], [end], [end - start], cache.page_size, device)
        attention = PagedAttention(cache, meta)
        ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=device)
        positions = torch.arange(start, end, dtype=torch.long, device=device)
        hidden.append(model(ids, positions, wrap(attention) if wrap else attention))
    return torch.cat(hidden)

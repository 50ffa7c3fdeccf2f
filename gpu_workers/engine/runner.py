"""Owns the model and the KV tensors; turns a scheduled batch into next-token logits."""

from __future__ import annotations

import torch

from gpu_workers.engine.scheduler import ScheduledBatch
from gpu_workers.kv import AttentionMetadata, KVCache, PagedAttention


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, device: str):
        self.model = model
        self.cache = cache
        self.device = device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        """Compute the batch's new tokens; return the rows that reached their last token and their logits.

        A row whose prompt chunk stops short of the end produces no logits this step.
        """
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
        hidden = self.model(ids, pos, PagedAttention(self.cache, meta))
        if not last_rows:
            return [], hidden.new_empty((0, 0), dtype=torch.float32)
        logits = self.model.compute_logits(hidden[torch.tensor(last_tokens, device=self.device)])
        return last_rows, logits.float().cpu()

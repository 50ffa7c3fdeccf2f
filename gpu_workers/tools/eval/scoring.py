"""Log-probabilities at every position of a sequence, computed through an engine's own paged KV cache.

The engine only returns logits for a sequence's last token; quality metrics need the whole distribution
at every position. The sequence is prefilled in chunks, so every attention read, including the chunk's
own tokens, goes through the cache in the engine's KV format: an FP8 cache is written and read back
exactly as it is when serving.
"""

from __future__ import annotations

import torch

from gpu_workers.engine import Engine
from gpu_workers.engine.runner import forward_sequence
from gpu_workers.kv.manager import PageTable


@torch.inference_mode()
def score_logprobs(engine: Engine, token_ids: list[int], chunk_size: int = 64) -> torch.Tensor:
    """Float32 log-softmax [len(token_ids), vocab]: row i is the model's distribution of token i + 1.

    Must not run while the engine is stepping other requests in another thread. The pages are taken from
    and given back to the engine's pool.
    """
    if not 0 < len(token_ids) <= engine.max_model_len:
        raise ValueError(f"can score 1..{engine.max_model_len} tokens, got {len(token_ids)}")
    table = PageTable()
    engine.pages.grow(table, len(token_ids))
    try:
        hidden = forward_sequence(engine.model, engine.cache, table.pages, token_ids, chunk_size)
        return torch.log_softmax(engine.model.compute_logits(hidden).float(), dim=-1).cpu()
    finally:
        engine.pages.release(table)

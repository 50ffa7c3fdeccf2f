"""Paged KV cache: page ids and refcounts, page tables, prefix cache, integrity tags, the K/V tensors and
the attention a model layer calls through them."""

from gpu_workers.kv.attention import AttentionMetadata, PagedAttention
from gpu_workers.kv.cache import KVCache
from gpu_workers.kv.pool import OutOfPages, PagePool
from gpu_workers.kv.spec import KVSpec

__all__ = ["AttentionMetadata", "KVCache", "KVSpec", "OutOfPages", "PagePool", "PagedAttention"]

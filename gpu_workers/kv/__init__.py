"""Paged KV cache: page ids and refcounts, page tables, prefix cache, integrity tags, the K/V tensors and
the per-step metadata attention reads them through (``model.attention`` attends)."""

from gpu_workers.kv.cache import KVCache
from gpu_workers.kv.metadata import AttentionMetadata
from gpu_workers.kv.pool import OutOfPages, PagePool
from gpu_workers.kv.spec import KVSpec

__all__ = ["AttentionMetadata", "KVCache", "KVSpec", "OutOfPages", "PagePool"]

"""Paged KV cache: page ids and refcounts, page tables, and attention that reads through them."""

from gpu_workers.kv.attention import AttentionMetadata, PagedAttention, paged_attention
from gpu_workers.kv.cache import KVCache
from gpu_workers.kv.pool import OutOfPages, PagePool
from gpu_workers.kv.spec import KVSpec

__all__ = [
    "AttentionMetadata",
    "KVCache",
    "KVSpec",
    "OutOfPages",
    "PagePool",
    "PagedAttention",
    "paged_attention",
]

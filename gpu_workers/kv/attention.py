"""What a model layer's attention reads through during one step: per-step metadata built from page tables,
and ``PagedAttention``, which writes the new K/V into the cache and attends (``kernels.paged_attention``).

One step packs the new tokens of every scheduled sequence into a flat batch of T tokens. Sequence i
contributes ``query_lens[i]`` tokens, the last ones of its ``context_lens[i]`` cached tokens (prefill
chunks and decode tokens are the same thing with different lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_workers.kernels.paged_attention import paged_attention
from gpu_workers.kv.cache import KVCache, WriteSpans


@dataclass
class _Group:
    """Sequences attended together: padded query/key index maps and the mask, built once per step."""

    q_index: torch.Tensor  # [B, Q] flat token index of each padded query row
    q_valid: torch.Tensor  # [B, Q] bool
    key_slots: torch.Tensor  # [B, K] cache slot of each key position
    key_pos: torch.Tensor  # [B, K] position of each key
    q_pos: torch.Tensor  # [B, Q] position of each query


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] cache slot each new token is written to
    query_lens: list[int]
    context_lens: list[int]
    page_tables: list[list[int]]
    page_size: int
    groups: list[_Group]
    spans: WriteSpans | None = None  # which sequence each new token belongs to (dynamic FP8 scales)

    @classmethod
    def build(
        cls,
        page_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        if not (len(page_tables) == len(context_lens) == len(query_lens)):
            raise ValueError("page_tables, context_lens and query_lens must have one entry per sequence")
        slots: list[int] = []
        token_seq: list[int] = []
        prev_page: list[int] = []
        for row, (table, ctx, q) in enumerate(zip(page_tables, context_lens, query_lens, strict=True)):
            if q <= 0 or q > ctx:
                raise ValueError(f"query length {q} must be in 1..context length {ctx}")
            if len(table) * page_size < ctx:
                raise ValueError(f"page table of {len(table)} pages cannot hold {ctx} tokens")
            for pos in range(ctx - q, ctx):
                slots.append(table[pos // page_size] * page_size + pos % page_size)
            token_seq.extend([row] * q)
            prev_page.append(table[(ctx - q - 1) // page_size] if ctx > q else -1)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        # Decode rows (one query token) and prefill rows are padded separately so that one long
        # prefill chunk does not pad every decode row to its length.
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        prefill = [i for i, q in enumerate(query_lens) if q > 1]
        groups = [
            _build_group(members, page_tables, context_lens, query_lens, starts, page_size, device)
            for members in (decode, prefill)
            if members
        ]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            page_tables=[list(t) for t in page_tables],
            page_size=page_size,
            groups=groups,
            spans=WriteSpans(
                torch.tensor(token_seq, dtype=torch.long, device=device),
                torch.tensor(prev_page, dtype=torch.long, device=device),
            ),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())


def _build_group(members, page_tables, context_lens, query_lens, starts, page_size, device) -> _Group:
    max_q = max(query_lens[i] for i in members)
    max_k = max(context_lens[i] for i in members)
    q_index, q_valid, q_pos, key_slots, key_pos = [], [], [], [], []
    for i in members:
        q, ctx, table = query_lens[i], context_lens[i], page_tables[i]
        q_index.append([starts[i] + min(j, q - 1) for j in range(max_q)])
        q_valid.append([j < q for j in range(max_q)])
        q_pos.append([ctx - q + min(j, q - 1) for j in range(max_q)])
        positions = [min(p, ctx - 1) for p in range(max_k)]
        key_slots.append([table[p // page_size] * page_size + p % page_size for p in positions])
        key_pos.append(list(range(max_k)))

    def t(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)

    return _Group(t(q_index), t(q_valid, torch.bool), t(key_slots), t(key_pos), t(q_pos))


class PagedAttention:
    """The attention a model layer calls during one step: write the new K/V, then attend through pages."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        self.cache = cache
        self.meta = meta

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        self.cache.write(layer, k, v, self.meta.slot_mapping, self.meta.spans)
        k_slots, v_slots = self.cache.layer(layer)
        k_scale, v_scale = self.cache.layer_scales(layer)
        return paged_attention(q, k_slots, v_slots, self.meta, scale, sliding_window, k_scale, v_scale)

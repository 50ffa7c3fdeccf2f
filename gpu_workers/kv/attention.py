"""What a model layer's attention reads through during one step: per-step metadata built from page tables,
and ``PagedAttention``, which writes the new K/V into the cache and attends (``kernels.paged_attention``).

One step packs the new tokens of every scheduled sequence into a flat batch of T tokens. Sequence i
contributes ``query_lens[i]`` tokens, the last ones of its ``context_lens[i]`` cached tokens (prefill
chunks and decode tokens are the same thing with different lengths). The metadata is built once per step
with tensor operations (no per-token Python) and read by every layer: decode rows (one query each) are
attended together through their block tables, prefill rows one sequence at a time, unpadded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_workers.kernels.paged_attention import paged_attention
from gpu_workers.kv.cache import KVCache, WriteSpans

# Decode rows gathered together are padded to the longest; rows sorted by length and split into a few
# groups of at least this many pad far less, for one more attention call per group.
DECODE_GROUPS, MIN_GROUP_ROWS = 4, 8


@dataclass
class DecodeRows:
    """The step's one-token rows: what a paged decode kernel reads, and their masks (one per window)."""

    rows: torch.Tensor  # [B] flat token index of each decode row
    block_tables: torch.Tensor  # [B, P] page ids, padded with the row's last page
    seq_lens: torch.Tensor  # [B] tokens each row attends to (its own included)
    groups: list[DecodeRows] = field(default_factory=list)  # rows of similar length, each padded apart
    _derived: dict = field(default_factory=dict, repr=False)  # masks and int32 tables, built on first use

    @classmethod
    def build(cls, rows: torch.Tensor, tables: torch.Tensor, lens: list[int], page_size: int) -> DecodeRows:
        """Decode rows with their tables cut to their longest row; grouped by length when there are many."""
        seq_lens = torch.tensor(lens, dtype=torch.long, device=rows.device)
        whole = cls(rows, tables[:, : -(-max(lens) // page_size)], seq_lens)
        num_groups = min(DECODE_GROUPS, len(lens) // MIN_GROUP_ROWS)
        if num_groups > 1:
            order = sorted(range(len(lens)), key=lens.__getitem__)
            size = -(-len(order) // num_groups)
            # Groups as wide (in pages) as the next pad no less apart than together: they stay one call.
            split: list[tuple[int, list[int]]] = []  # (width in pages, rows)
            for start in range(0, len(order), size):
                members = order[start : start + size]
                width = -(-lens[members[-1]] // page_size)
                if split and split[-1][0] == width:
                    split[-1][1].extend(members)
                else:
                    split.append((width, members))
            if len(split) > 1:
                for width, members in split:
                    index = torch.tensor(members, dtype=torch.long, device=rows.device)
                    whole.groups.append(cls(rows[index], tables[index, :width], seq_lens[index]))
        return whole

    def int32_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``block_tables`` and ``seq_lens`` as int32, what the decode kernels read; built once per step."""
        cached = self._derived.get("int32")
        if cached is None:
            cached = self._derived["int32"] = (
                self.block_tables.to(torch.int32),
                self.seq_lens.to(torch.int32),
            )
        return cached

    def mask(self, page_size: int, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, 1, P * page_size] additive mask in ``dtype`` (0 where a row attends, -inf where not) over
        the gathered positions; built once per step. SDPA takes it as is, where a bool mask would be
        converted on every call of every layer."""
        key = (sliding_window, dtype)
        mask = self._derived.get(key)
        if mask is None:
            positions = torch.arange(self.block_tables.shape[1] * page_size, device=self.seq_lens.device)
            lens = self.seq_lens[:, None]
            valid = positions[None, :] < lens
            if sliding_window is not None:
                valid &= positions[None, :] >= lens - sliding_window
            mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(
                ~valid, float("-inf")
            )
            mask = self._derived[key] = mask[:, None, None, :]
        return mask


@dataclass
class PrefillRow:
    """One sequence's chunk of several tokens: flat tokens [start, end) at the end of its context."""

    start: int
    end: int
    context_len: int
    pages: torch.Tensor  # [ceil(context_len / page_size)] the pages holding its context


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] cache slot each new token is written to
    query_lens: list[int]
    context_lens: list[int]
    page_size: int
    decode: DecodeRows | None
    prefill: list[PrefillRow]
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
        for table, ctx, q in zip(page_tables, context_lens, query_lens, strict=True):
            if q <= 0 or q > ctx:
                raise ValueError(f"query length {q} must be in 1..context length {ctx}")
            if len(table) * page_size < ctx:
                raise ValueError(f"page table of {len(table)} pages cannot hold {ctx} tokens")
        # Tables padded with their last page: every entry names a real page, padding is masked.
        width = max(-(-ctx // page_size) for ctx in context_lens)
        tables = torch.tensor(
            [table[:width] + [table[-1]] * (width - len(table)) for table in page_tables],
            dtype=torch.long,
            device=device,
        )
        ctx = torch.tensor(context_lens, dtype=torch.long, device=device)
        q = torch.tensor(query_lens, dtype=torch.long, device=device)
        seqs = torch.arange(len(query_lens), device=device)
        token_seq = seqs.repeat_interleave(q)
        starts = q.cumsum(0) - q
        positions = torch.arange(len(token_seq), device=device) - starts[token_seq] + (ctx - q)[token_seq]
        slots = tables[token_seq, positions // page_size] * page_size + positions % page_size
        first = ctx - q  # position of each sequence's first new token
        prev_page = torch.where(first > 0, tables[seqs, (first - 1).clamp_min(0) // page_size], -1)
        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        decode = None
        if decode_rows:
            index = torch.tensor(decode_rows, dtype=torch.long, device=device)
            lens = [context_lens[i] for i in decode_rows]
            decode = DecodeRows.build(starts[index], tables[index], lens, page_size)
        offsets = starts.tolist()
        prefill = [
            PrefillRow(
                offsets[i], offsets[i] + n, context_lens[i], tables[i, : -(-context_lens[i] // page_size)]
            )
            for i, n in enumerate(query_lens)
            if n > 1
        ]
        return cls(
            slot_mapping=slots,
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            page_size=page_size,
            decode=decode,
            prefill=prefill,
            spans=WriteSpans(token_seq, prev_page),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())


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

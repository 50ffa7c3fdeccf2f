"""What a model layer's attention reads through during one step: where the step's new tokens go in the
cache and which pages each sequence attends to, built from page tables (``model.attention`` reads it).

One step packs the new tokens of every scheduled sequence into a flat batch of T tokens. Sequence i
contributes ``query_lens[i]`` tokens, the last ones of its ``context_lens[i]`` cached tokens (prefill
chunks and decode tokens are the same thing with different lengths). The metadata is built once per step
with array operations (no per-token Python) and read by every layer: decode rows (one query each) are
attended together through their block tables, prefill rows in groups of equal context and chunk lengths
(unpadded: a group is one call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_workers.kv.cache import WriteSpans

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
    def build(
        cls,
        rows: np.ndarray,
        tables: np.ndarray,
        lens: np.ndarray,
        page_size: int,
        device: torch.device | str,
    ) -> DecodeRows:
        """Decode rows (flat token index ``rows``, page ``tables``, context ``lens``, as int64 arrays) with their
        tables cut to their longest row; grouped by length when there are many."""
        whole = cls._of(rows, tables[:, : -(-int(lens.max()) // page_size)], lens, device)
        num_groups = min(DECODE_GROUPS, len(lens) // MIN_GROUP_ROWS)
        if num_groups > 1:
            order = np.argsort(lens, kind="stable")
            size = -(-len(order) // num_groups)
            # Groups as wide (in pages) as the next pad no less apart than together: they stay one call.
            split: list[tuple[int, list[np.ndarray]]] = []  # (width in pages, rows)
            for start in range(0, len(order), size):
                members = order[start : start + size]
                width = -(-int(lens[members[-1]]) // page_size)
                if split and split[-1][0] == width:
                    split[-1][1].append(members)
                else:
                    split.append((width, [members]))
            if len(split) > 1:
                for width, parts in split:
                    index = np.concatenate(parts)
                    whole.groups.append(cls._of(rows[index], tables[index, :width], lens[index], device))
        return whole

    @classmethod
    def _of(
        cls, rows: np.ndarray, tables: np.ndarray, lens: np.ndarray, device: torch.device | str
    ) -> DecodeRows:
        made = cls(_tensor(rows, device), _tensor(tables, device), _tensor(lens, device))
        if _on_cpu(device):  # what the CPU kernel reads, without a conversion per step
            made._derived["int32"] = (
                torch.from_numpy(tables.astype(np.int32)),
                torch.from_numpy(lens.astype(np.int32)),
            )
        return made

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
class PrefillGroup:
    """The step's chunks of several tokens that share a context and a chunk length (a burst of same-length
    prompts is one group): each the last ``query_len`` tokens of its ``context_len``, attended in one call."""

    tokens: torch.Tensor  # [rows * query_len] flat token indices, row by row
    span: slice | None  # the same tokens as a slice, when they lie back to back in the flat batch
    rows: int
    context_len: int
    query_len: int
    # Its rows' page tables, ceil(context_len / page_size) pages each, row after row, start at this entry of
    # the step's ``AttentionMetadata.prefill_pages``.
    first_page: int


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] cache slot each new token is written to
    query_lens: list[int]
    context_lens: list[int]
    page_size: int
    decode: DecodeRows | None
    prefill: list[PrefillGroup]
    # Every prefill group's tables, flat, group after group: a layer gathers (and dequantises) them at once.
    prefill_pages: torch.Tensor | None
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
        # Index arithmetic in numpy (a few µs an op, where each small torch op costs several), then one
        # tensor per result. Tables padded with their last page: every entry names a real page, padding is
        # masked.
        contexts = np.asarray(context_lens, dtype=np.int64)
        width = -(-int(contexts.max()) // page_size)
        tables = np.array(
            [table[:width] + [table[-1]] * (width - len(table)) for table in page_tables], dtype=np.int64
        )
        if max(query_lens) == 1:
            return cls._decode_only(tables, contexts, query_lens, context_lens, page_size, device)
        queries = np.asarray(query_lens, dtype=np.int64)
        seqs = np.arange(len(queries))
        token_seq = np.repeat(seqs, queries)
        starts = np.cumsum(queries) - queries
        first = contexts - queries  # position of each sequence's first new token
        positions = np.arange(len(token_seq)) - starts[token_seq] + first[token_seq]
        slots = tables[token_seq, positions // page_size] * page_size + positions % page_size
        prev_page = np.where(first > 0, tables[seqs, np.maximum(first - 1, 0) // page_size], -1)
        decode_rows = np.flatnonzero(queries == 1)
        decode = None
        if len(decode_rows):
            decode = DecodeRows.build(
                starts[decode_rows], tables[decode_rows], contexts[decode_rows], page_size, device
            )
        chunks: dict[tuple[int, int], list[int]] = {}
        for i, n in enumerate(query_lens):
            if n > 1:
                chunks.setdefault((context_lens[i], n), []).append(i)
        prefill, prefill_tables, first_page = [], [], 0
        for (ctx, n), members in chunks.items():
            tokens = (starts[members][:, None] + np.arange(n)).reshape(-1)
            first = int(tokens[0])
            back_to_back = bool((tokens == np.arange(first, first + len(tokens))).all())
            group_tables = tables[members, : -(-ctx // page_size)]
            prefill.append(
                PrefillGroup(
                    tokens=_tensor(tokens, device),
                    span=slice(first, first + len(tokens)) if back_to_back else None,
                    rows=len(members),
                    context_len=ctx,
                    query_len=n,
                    first_page=first_page,
                )
            )
            prefill_tables.append(group_tables.reshape(-1))
            first_page += group_tables.size
        return cls(
            slot_mapping=_tensor(slots, device),
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            page_size=page_size,
            decode=decode,
            prefill=prefill,
            prefill_pages=_tensor(np.concatenate(prefill_tables), device) if prefill else None,
            spans=WriteSpans(_tensor(token_seq, device), _tensor(prev_page, device)),
        )

    @classmethod
    def _decode_only(
        cls,
        tables: np.ndarray,
        contexts: np.ndarray,
        query_lens: list[int],
        context_lens: list[int],
        page_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """``build`` for a step of one new token per sequence (token i is sequence i's), in a third of the
        general case's array operations: every step of a decode-bound engine builds one, and a step's
        host work runs with the weights' bytes just through the caches (each operation several times its
        cost alone)."""
        rows = np.arange(len(contexts))
        last = contexts - 1  # the position of each sequence's new token
        slots = tables[rows, last // page_size] * page_size + last % page_size
        prev_page = np.where(last > 0, tables[rows, np.maximum(last - 1, 0) // page_size], -1)
        return cls(
            slot_mapping=_tensor(slots, device),
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            page_size=page_size,
            decode=DecodeRows.build(rows, tables, contexts, page_size, device),
            prefill=[],
            prefill_pages=None,
            spans=WriteSpans(_tensor(rows, device), _tensor(prev_page, device)),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())


def _tensor(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if _on_cpu(device) else tensor.to(device)


def _on_cpu(device: torch.device | str) -> bool:
    return device == "cpu" or torch.device(device).type == "cpu"

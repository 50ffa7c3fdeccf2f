"""Decode steps replayed from CUDA graphs (``EngineConfig.cuda_graphs``).

On a GPU a decode step of a small or mid-sized model is bound by the host: on the H200 a 1B model's
step kept the GPU busy 14% of the time, the rest Python and ~720 kernel launches (BENCHMARKS.md, "The
engine on the GPU"). A CUDA graph records a step's launches once and replays them in one call. What a
graph needs, and this provides:
- fixed addresses: each input of the step is a static buffer the graph reads (token ids, positions,
  cache slots, block tables at the full context's width, context lengths, each row's previous page),
  refilled from the host before every replay;
- fixed shapes: a batch is padded to a bucket size (1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to
  ``max_num_seqs``); padded rows attend to and write a scratch page no sequence owns
  (``KVCache.scratch_page``), and their logits are dropped; a real row's table is padded with its own
  last page, as the ordinary step pads it, so no real row reads the scratch page;
- no host sync inside: FP8 page scales are opened without a masked write (``KVCache._open_pages``).

Every bucket's graph is captured when the engine is built, before it serves: each bucket runs once
eagerly on padded rows only (compiling and warming up the kernels, on a side stream as torch's graph
documentation asks), then is captured; no other thread touches the device then, and a capture that fails
fails the engine's construction, not a request. Steps with prefill chunks, or rows that do not sample
this step, run the ordinary eager path. Only models whose forward never reads a tensor back to the host
can be captured (``cuda_graph_safe``: not the MoE models, whose routing counts tokens per expert on the
host). On a CPU nothing is captured: the static buffers run eagerly every time, which is how the tests
check this path against the ordinary step.

A graphed step's block tables are as wide as ``max_model_len``: the Triton decode kernel plans its K/V
splits for that width, not for the batch's longest row (fewer programs at small batch and short context).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_workers.engine.scheduler import ScheduledBatch
from gpu_workers.kv import AttentionMetadata, KVCache
from gpu_workers.kv.cache import WriteSpans
from gpu_workers.kv.metadata import DecodeRows
from gpu_workers.model.attention import PagedAttention

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """The static buffers of a padded decode step, and a captured graph per batch-size bucket."""

    def __init__(
        self, model: torch.nn.Module, cache: KVCache, max_batch: int, max_model_len: int, device: str
    ):
        if cache.scratch_page is None:
            raise ValueError(
                "a CUDA-graph decode step needs a scratch page in the cache (KVCache.scratch_page)"
            )
        if not getattr(model, "cuda_graph_safe", False):
            raise ValueError(
                f"{type(model).__name__} cannot run decode steps from CUDA graphs: its forward reads tensors "
                "back to the host (MoE routing); leave cuda_graphs off"
            )
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        size = self.buckets[-1]
        self.width = -(-max_model_len // cache.page_size)  # pages of the longest sequence
        self.scratch_slot = cache.scratch_page * cache.page_size

        def buffer(fill: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.full(shape or (size,), fill, dtype=dtype, device=self.device)

        self.ids = buffer(0, torch.long)
        self.positions = buffer(0, torch.long)
        self.slots = buffer(self.scratch_slot, torch.long)
        self.prev_page = buffer(-1, torch.long)
        self.rows = torch.arange(size, device=self.device)
        self.tables = buffer(cache.scratch_page, torch.int32, size, self.width)
        self.lens = buffer(1, torch.int32)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = 0  # decode steps served from the static buffers
        self.replays = 0  # of them, replayed from a captured graph
        if self.device.type == "cuda":
            self._capture_all()

    def serves(self, batch: ScheduledBatch) -> bool:
        """A decode-only step in which every row samples, of at most the largest bucket's rows."""
        if not batch.seqs or len(batch.seqs) > self.buckets[-1]:
            return False
        return all(
            n == 1 and seq.num_computed + 1 == seq.num_tokens
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )

    def run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        """The step's logits [rows, vocab] (float32, on the device) for every row, in order: a view of the
        graph's output where the model computes in float32, read by the sampler before the next replay."""
        n = len(batch.seqs)
        size = next(b for b in self.buckets if b >= n)
        self._fill(batch, size)
        self.steps += 1
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            self.replays += 1
        else:
            logits = self._forward(size)
        return list(range(n)), logits[:n].float()

    def _fill(self, batch: ScheduledBatch, size: int) -> None:
        """Copy the step's rows into the static buffers; rows from n to ``size`` read and write scratch."""
        page_size = self.cache.page_size
        ids = np.zeros(size, dtype=np.int64)
        positions = np.zeros(size, dtype=np.int64)
        slots = np.full(size, self.scratch_slot, dtype=np.int64)
        prev_page = np.full(size, -1, dtype=np.int64)
        tables = np.full((size, self.width), self.cache.scratch_page, dtype=np.int32)
        lens = np.ones(size, dtype=np.int32)
        for i, seq in enumerate(batch.seqs):
            position = seq.num_computed  # the one new token's
            pages = seq.table.pages
            ids[i] = seq.tokens(position, position + 1)[0]
            positions[i] = position
            slots[i] = pages[position // page_size] * page_size + position % page_size
            if position > 0:
                prev_page[i] = pages[(position - 1) // page_size]
            tables[i, : len(pages)] = pages
            tables[i, len(pages) :] = pages[-1]  # as the ordinary step pads: a row reads only its own pages
            lens[i] = position + 1
        for static, host in (
            (self.ids, ids),
            (self.positions, positions),
            (self.slots, slots),
            (self.prev_page, prev_page),
            (self.tables, tables),
            (self.lens, lens),
        ):
            static[:size].copy_(torch.from_numpy(host))

    def _metadata(self, size: int) -> AttentionMetadata:
        decode = DecodeRows(self.rows[:size], self.tables[:size], self.lens[:size])
        decode._derived["int32"] = (self.tables[:size], self.lens[:size])  # already what the kernels read
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            query_lens=[1] * size,
            context_lens=[self.width * self.cache.page_size] * size,  # the bound; ``lens`` holds each row's
            page_size=self.cache.page_size,
            decode=decode,
            prefill=[],
            prefill_pages=None,
            spans=WriteSpans(self.rows[:size], self.prev_page[:size]),
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(
            self.ids[:size], self.positions[:size], PagedAttention(self.cache, self._metadata(size))
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Warm up, then capture, every bucket, largest first (the smaller ones reuse its memory pool), on
        padded rows only: every row reads and writes the scratch page."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for size in self.buckets:
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = None
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)

"""The engine's public face: add, abort, generate and stream requests, warm up, run the step loop in the
background, report stats. The step itself and admission are ``core.EngineCore``'s."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from gpu_workers.engine.admission import Prompt
from gpu_workers.engine.core import EngineCore
from gpu_workers.engine.params import EngineConfig, RequestOutput, SamplingParams, StreamEvent
from gpu_workers.engine.runner import load_for_serving
from gpu_workers.kv.transfer import KVBlock

log = logging.getLogger(__name__)


class Engine(EngineCore):
    """Continuous batching over a paged KV cache. Thread-safe: any thread may add, abort or step."""

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None):
        super().__init__(model, tokenizer, config)
        log.info("engine computes in %s (%s)", self.dtype.name, self.dtype.reason)
        if self.packed_linears:
            log.info("%d linears run oneDNN's packed bf16 GEMM", self.packed_linears)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, config: EngineConfig | None = None, progress: bool = False
    ) -> Engine:
        """Load an HF checkpoint folder (config.json, safetensors, optional tokenizer.json)."""
        from gpu_workers.tokenizer import load_tokenizer

        config = config or EngineConfig()
        return cls(load_for_serving(path, config, progress), load_tokenizer(path), config)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
        export_kv: str | None = None,
        kv_import: KVBlock | None = None,
        streamed_output: int = 0,
    ) -> str:
        """Queue a request; returns its id. A bad request finishes at once with finish_reason "error".

        ``tenant`` scopes the prefix cache: only requests of the same tenant share cached pages.
        ``export_kv`` (a KV format name) makes the finished request carry its prompt's KV as a KVBlock
        (``RequestOutput.kv`` / the final event's ``kv``); ``kv_import`` starts a request from such a
        block instead of computing those tokens: the prefill → decode hand-off. A request that exports its
        KV and ends on ``max_tokens`` continues elsewhere, so it keeps back text that a later token may
        still complete (part of a stop string or of a character); the continuation passes
        ``streamed_output``: how many of its prompt's last ids are output an earlier phase streamed. The
        detokeniser replays them without emitting them again, so such text is released or stopped here.
        """
        seq = self._add(
            prompt,
            params or SamplingParams(),
            request_id,
            on_event,
            tenant,
            export_kv,
            kv_import,
            streamed_output,
        )
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if it is unknown or already finished."""
        with self._lock:
            seq = self._requests.get(request_id)
            if seq is None:
                return False
            self._finish(seq, "abort")
            seq.emit([], seq.detokenizer.finish() if seq.detokenizer else "")
            return True

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        tenant: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, batched together; one output per prompt, in order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        seqs = [self._add(p, sp, None, None, tenant) for p, sp in zip(prompts, params, strict=True)]
        while any(s.finish_reason is None for s in seqs):
            if not self._loop.running:
                self.step()
            else:
                with self._work:
                    self._work.wait(timeout=0.05)
        return [s.output() for s in seqs]

    def warm_up(self, max_tokens: int = 3) -> float:
        """Run one throwaway request (a prompt of two pages and a token, ``max_tokens`` greedy tokens: a
        prefill step, then decode steps) before serving, so that what a first step builds, the CPU
        kernels compiled or loaded from numba's cache and oneDNN's primitives, is built before a user's
        request waits on it. The counters are left as they were and its pages are freed (its prefix-cache
        entries carry a salt no request shares). Call it before ``start``. Returns the seconds it took."""
        begin = time.perf_counter()
        counters = dict(self._counters)
        cache = self.pages.prefix_cache
        queried = (cache.query_tokens, cache.hit_tokens) if cache is not None else (0, 0)
        length = min(2 * self.config.page_size + 1, self.max_model_len - max_tokens)
        vocab = self.model.config.vocab_size
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        [output] = self.generate([[(11 + 7 * i) % vocab for i in range(length)]], params)
        if output.error is not None:
            raise RuntimeError(f"the warm-up request failed: {output.error.message}")
        self._counters.update(counters)
        if cache is not None:
            cache.query_tokens, cache.hit_tokens = queried
        return time.perf_counter() - begin

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tenant: str | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield a StreamEvent per step that produced tokens; the last one has finish_reason set.

        Closing the iterator early aborts the request and frees its pages.
        """
        events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        seq = self._add(prompt, params or SamplingParams(), request_id, events.put, tenant)
        try:
            while True:
                event = self._next_event(events)
                if event is None:
                    continue
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if seq.finish_reason is None:
                self.abort(seq.request_id)

    def _next_event(self, events: queue.SimpleQueue[StreamEvent]) -> StreamEvent | None:
        try:
            return events.get_nowait()
        except queue.Empty:
            pass
        if not self._loop.running:
            self.step()  # nobody else is stepping: this caller drives the engine for every request
            return None
        try:
            return events.get(timeout=0.1)
        except queue.Empty:
            return None

    def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Run the step loop on a background thread (for servers); ``stream`` then just waits.

        ``on_failure(error)`` runs once, on the loop thread, if the engine stops for good (``failed``).
        """
        with self._lock:
            if not self._loop.running:
                self._failures.on_failure = on_failure
                self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work()

    def stats(self) -> dict:
        """Gauges and counters, read without the engine lock: heartbeats never wait for a step. Each value
        is current; two of them may straddle a step."""
        cache = self.pages.prefix_cache
        return {
            "dtype": self.dtype.name,
            "dtype_reason": self.dtype.reason,
            "packed_linears": self.packed_linears,
            "kv_capacity_tokens": self.pages.capacity_tokens,
            "kv_pages_total": self.pages.num_pages,
            "kv_pages_used": self.pages.num_used,
            "kv_page_size": self.pages.page_size,
            "kv_cache_bytes": self.cache.nbytes,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_bytes_per_token": self.cache.bytes_per_token,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "integrity_check": self.config.integrity_check,
            "integrity_mismatches": self.pages.integrity.mismatches,
            "prefix_cache_query_tokens": cache.query_tokens if cache else 0,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_cache_pages": cache.num_cached if cache else 0,
            "prefix_cache_stale_entries": cache.stale_entries if cache else 0,
            "failed": self.failed is not None,
            "cuda_graphs": self.config.cuda_graphs,
            # decode steps served from static buffers, and of them replayed from a captured graph
            "cuda_graph_steps": graphs.steps if (graphs := self.runner.graphs) is not None else 0,
            "cuda_graph_replays": graphs.replays if graphs is not None else 0,
            **self._counters,
        }

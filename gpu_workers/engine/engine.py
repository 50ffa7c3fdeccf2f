"""The engine: admit requests, step the scheduler and model, sample, stream tokens, free pages."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from gpu_workers.engine import admission
from gpu_workers.engine.admission import Prompt
from gpu_workers.engine.detokenizer import IncrementalDetokenizer
from gpu_workers.engine.failures import StepFailures
from gpu_workers.engine.grammar import Grammars
from gpu_workers.engine.graphs import DecodeGraphs
from gpu_workers.engine.params import (
    ENGINE_FAILED,
    EngineConfig,
    InvalidRequest,
    RequestError,
    RequestOutput,
    SamplingParams,
    StreamEvent,
)
from gpu_workers.engine.runner import ModelRunner
from gpu_workers.engine.sampling import apply_penalties, position_seed, sample, token_logprobs
from gpu_workers.engine.scheduler import Scheduler
from gpu_workers.engine.sequence import Sequence, Status
from gpu_workers.kernels.packed_linear import PackedLinear, pack_linears
from gpu_workers.kv import KVCache, transfer
from gpu_workers.kv.integrity import IntegrityTracker
from gpu_workers.kv.manager import PageManager
from gpu_workers.kv.prefix_cache import PrefixCache, prefix_cache_salt
from gpu_workers.kv.transfer import KVBlock
from gpu_workers.protocol import TokenLogprob

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching over a paged KV cache. Thread-safe: any thread may add, abort or step."""

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.dtype = config.compute_dtype
        log.info("engine computes in %s (%s)", self.dtype.name, self.dtype.reason)
        self.model = model
        self.tokenizer = tokenizer
        self.packed_linears = sum(isinstance(m, PackedLinear) for m in model.modules())
        if self.packed_linears:
            log.info("%d linears run oneDNN's packed bf16 GEMM", self.packed_linears)
        model_config = model.config
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        spec = model.kv_spec
        num_pages = KVCache.pages_for_budget(spec, config.kv_budget_bytes, config.page_size, config.kv_dtype)
        if num_pages < 1:
            page_bytes = KVCache.page_bytes(spec, config.page_size, config.kv_dtype)
            raise ValueError(
                f"kv_budget_bytes={config.kv_budget_bytes} holds no KV page: one page of {config.page_size} "
                f"tokens takes {page_bytes} bytes for this model; raise the budget or lower page_size"
            )
        self.cache = KVCache(
            spec, num_pages, config.page_size, config.kv_dtype, config.device, config.kv_scales
        )
        # The last page may be kept aside as a scratch page, never handed to a sequence: CUDA graphs' padded
        # rows write there, and with it FP8 pages with dynamic scales open without a masked write, which on a
        # GPU reads the mask's count back to the host (a sync per layer and tensor, every step).
        if config.cuda_graphs or (self.cache.opens_pages and torch.device(config.device).type == "cuda"):
            if num_pages < 2:
                raise ValueError(
                    f"kv_budget_bytes={config.kv_budget_bytes} holds one KV page; this engine keeps one aside "
                    "(CUDA graphs' padded rows, FP8 pages opened without a host sync): raise the budget"
                )
            num_pages -= 1
            self.cache.scratch_page = num_pages
        self.pages = PageManager(
            num_pages,
            config.page_size,
            IntegrityTracker(num_pages, config.device) if config.integrity_check else None,
            PrefixCache() if config.prefix_cache else None,
        )
        self._salt_secret = config.prefix_cache_secret or os.urandom(32)
        self.scheduler = Scheduler(self.pages, config.max_num_seqs, config.max_num_batched_tokens)
        graphs = (
            DecodeGraphs(model, self.cache, config.max_num_seqs, self.max_model_len, config.device)
            if config.cuda_graphs
            else None
        )
        self.runner = ModelRunner(model, self.cache, config.device, graphs)
        eos = set(model_config.eos_token_ids or [])
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.grammars = Grammars(tokenizer, sorted(eos), model.config.vocab_size)
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._loop_thread: threading.Thread | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self._counters = {"steps": 0, "generated_tokens": 0, "computed_tokens": 0, "failed_steps": 0}
        self._failures = StepFailures()
        self._exports: list[tuple[Sequence, StreamEvent]] = []  # final events waiting for their KV conversion
        self.failed: BaseException | None = None  # what stopped the engine for good; None while it serves

    @classmethod
    def from_pretrained(
        cls, path: str | Path, config: EngineConfig | None = None, progress: bool = False
    ) -> Engine:
        """Load an HF checkpoint folder (config.json, safetensors, optional tokenizer.json)."""
        from gpu_workers.model import load_model
        from gpu_workers.tokenizer import load_tokenizer

        config = config or EngineConfig()
        model = load_model(
            path, dtype=config.torch_dtype, device=config.device, progress=progress, weights=config.weights
        )
        model.fuse_projections()
        if config.device == "cpu":
            pack_linears(model)
            if model.pack_tied_output():
                weight = model.model.embed_tokens.weight
                log.info(
                    "the tied output projection runs on a packed copy of the embedding (%.1f MiB more)",
                    weight.numel() * weight.element_size() / 2**20,
                )
        return cls(model, load_tokenizer(path), config)

    # -- requests -------------------------------------------------------------------------------

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
            if self._loop_thread is None:
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
        if self._loop_thread is None:
            self.step()  # nobody else is stepping: this caller drives the engine for every request
            return None
        try:
            return events.get(timeout=0.1)
        except queue.Empty:
            return None

    # -- the step loop ----------------------------------------------------------------------------

    def step(self) -> list[StreamEvent]:
        """Schedule, run the model once over the batch, sample, and emit events for the tokens produced.

        A step that raises fails only the requests in it (code ``internal_error``); the engine goes on
        unless the error says it cannot (``failures``): then every request ends with ``engine_failed``,
        ``failed`` holds the error and the ``on_failure`` callback of ``start`` runs.
        """
        with self._lock:
            if self.failed is not None:
                return []
            batch = None
            try:
                batch = self.scheduler.schedule()
                events = self._run(batch)
            except Exception as exc:
                events = self._step_failed(batch, exc)
            exports, self._exports = self._exports, []
            failed_now = self.failed is not None
        # Converting exported KV is the costly part of a hand-off: outside the lock, so adds, aborts and
        # other threads' work never wait for it.
        events += [self._deliver_export(seq, event) for seq, event in exports]
        if failed_now:
            self._notify_failure()
        return events

    def _run(self, batch) -> list[StreamEvent]:
        events = self._verify_integrity(batch) if self.config.integrity_check else []
        if not batch:
            return events
        events += self._import_kv(batch)
        if not batch:
            return events
        rows, logits = self.runner.run(batch)
        self._counters["steps"] += 1
        self._counters["computed_tokens"] += sum(batch.num_new_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
            self.pages.publish(seq.table, seq.tokens, seq.num_computed)
        sampling = [batch.seqs[r] for r in rows]
        params = [s.params for s in sampling]
        logits = self.grammars.mask(logits, [s.matcher for s in sampling])
        logits = apply_penalties(
            logits, params, [s.history() if s.params.has_penalties else ((), ()) for s in sampling]
        )
        tokens = sample(logits, params, [self._generator_for(s) for s in sampling])
        logprobs = token_logprobs(logits, params, tokens)
        events += [
            self._append_token(seq, token, logprob)
            for seq, token, logprob in zip(sampling, tokens, logprobs, strict=True)
        ]
        self._counters["generated_tokens"] += len(tokens)
        self._failures.succeeded()
        self._work.notify_all()
        return events

    def _step_failed(self, batch, exc: Exception) -> list[StreamEvent]:
        """End the requests of a failed step; stop the engine if it cannot go on."""
        self._counters["failed_steps"] += 1
        # A scheduler that raised left its queues half-updated: nothing it holds can be trusted.
        if self._failures.failed(exc) or batch is None:
            log.critical("engine step failed; the engine cannot go on", exc_info=exc)
            return self._fail_engine(exc)
        unfinished = [seq for seq in batch.seqs if seq.finish_reason is None]
        log.error("engine step failed; failing the %d requests in it", len(unfinished), exc_info=exc)
        error = RequestError(
            "internal_error",
            f"the engine step serving this request failed ({type(exc).__name__}: {exc}); "
            "the request was stopped, other requests continue",
        )
        events = []
        for seq in unfinished:
            self._finish(seq, "error", error)
            events.append(seq.emit([], ""))
        return events

    def _fail_engine(self, exc: BaseException) -> list[StreamEvent]:
        """Stop for good: end every request, refuse new ones."""
        self.failed = exc
        error = RequestError(ENGINE_FAILED, self._failure_message())
        events = []
        for seq in list(self._requests.values()):
            self._finish(seq, "error", error)
            events.append(seq.emit([], ""))
        return events

    def _failure_message(self) -> str:
        return (
            f"the engine stopped after an error it cannot recover from ({type(self.failed).__name__}: "
            f"{self.failed}); retry the request"
        )

    def _deliver_export(self, seq: Sequence, event: StreamEvent) -> StreamEvent:
        """Convert a finished request's KV copy to its export format, then deliver its final event."""
        try:
            seq.kv = event.kv = transfer.convert(seq.kv, seq.export_kv)
        except Exception as exc:
            log.exception("request %s: could not convert its KV to %s", seq.request_id, seq.export_kv)
            seq.finish_reason, seq.kv = "error", None
            seq.error = RequestError(
                "internal_error", f"could not convert the KV to {seq.export_kv} ({type(exc).__name__}: {exc})"
            )
            event = seq.event(event.token_ids, event.text)
        return seq.deliver(event)

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        """A seeded request draws from a generator keyed by (seed, position of the token being sampled),
        so its tokens do not depend on batching, preemption, or which pool sampled the earlier ones."""
        if seq.generator is None:
            return self._default_generator
        return seq.generator.manual_seed(position_seed(seq.params.seed, seq.num_tokens))

    def _import_kv(self, batch) -> list[StreamEvent]:
        """Copy handed-off KV (converted when it was added) into newly admitted sequences' pages; a block
        that cannot be copied fails only its request."""
        events = []
        for row in range(len(batch.seqs) - 1, -1, -1):
            seq = batch.seqs[row]
            if seq.kv_import is None:
                continue
            block, seq.kv_import = seq.kv_import, None
            try:
                transfer.write_pages(self.cache, seq.table.pages, block)
            except Exception as exc:
                log.exception("request %s: could not import its KV block", seq.request_id)
                del batch.seqs[row], batch.num_new_tokens[row]
                error = RequestError("internal_error", f"could not import KV ({type(exc).__name__}: {exc})")
                self._finish(seq, "error", error)
                events.append(seq.emit([], ""))
        return events

    def _verify_integrity(self, batch) -> list[StreamEvent]:
        """One batched check of every page the step will read; abort only the sequences that fail it."""
        mismatches = self.pages.integrity.verify(
            [s.table.pages for s in batch.seqs], [s.table.generations for s in batch.seqs]
        )
        if not mismatches:
            return []
        events = []
        for row in sorted({m.row for m in mismatches}, reverse=True):
            seq = batch.seqs[row]
            first = next(m for m in mismatches if m.row == row)
            error = RequestError(
                "kv_integrity_violation",
                f"KV page {first.page} was reallocated (expected generation {first.expected}, found "
                f"{first.found}); the request was stopped instead of reading another request's state",
            )
            del batch.seqs[row], batch.num_new_tokens[row]
            self._finish(seq, "error", error)
            events.append(seq.emit([], ""))
        return events

    def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Run the step loop on a background thread (for servers); ``stream`` then just waits.

        ``on_failure(error)`` runs once, on the loop thread, if the engine stops for good (``failed``).
        """
        with self._lock:
            if self._loop_thread is not None:
                return
            self._on_failure = on_failure
            self._loop_thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._loop_thread.start()

    def stop(self) -> None:
        with self._lock:
            thread, self._loop_thread = self._loop_thread, None
            self._work.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._work:
                while self._loop_thread is me and self.failed is None and not self.scheduler.has_work():
                    self._work.wait()
                if self._loop_thread is not me or self.failed is not None:
                    return
            try:
                self.step()
            except Exception as exc:  # step() contains its own failures; this is the last line, not the plan
                log.critical("engine loop failed", exc_info=exc)
                with self._lock:
                    if self.failed is None:
                        self._fail_engine(exc)
                self._notify_failure()
                return

    def _notify_failure(self) -> None:
        """Run ``on_failure`` once (outside the lock); what it raises is logged, the engine is down anyway."""
        callback, self._on_failure = self._on_failure, None
        if callback is None:
            return
        try:
            callback(self.failed)
        except Exception:
            log.exception("the engine's on_failure callback failed")

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

    # -- internals ----------------------------------------------------------------------------------

    def _add(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None,
        on_event,
        tenant: str | None,
        export_kv: str | None = None,
        kv_import: KVBlock | None = None,
        streamed_output: int = 0,
    ) -> Sequence:
        request_id = request_id or uuid.uuid4().hex
        seq = Sequence(request_id, [], params, 0, -1, on_event=on_event)
        try:
            if kv_import is not None:
                kv_import = self._prepare_import(kv_import)  # outside the lock: conversion is the costly part
            if params.grammar is not None:  # outside the lock too: compiling a schema can take a while
                seq.matcher = self._matcher(params.grammar, prompt, streamed_output)
            with self._lock:
                self._admit(seq, prompt, tenant, export_kv, kv_import, streamed_output)
        except InvalidRequest as exc:
            self._refuse(seq, RequestError(exc.code, exc.message))
        except Exception as exc:
            log.exception("request %s: could not be added", request_id)
            self._refuse(
                seq,
                RequestError("internal_error", f"could not add the request ({type(exc).__name__}: {exc})"),
            )
        return seq

    def _matcher(self, grammar, prompt: Prompt, streamed_output: int):
        """The grammar's matcher, advanced over the output an earlier phase generated (the prompt's last
        ``streamed_output`` ids): a request handed from prefill to decode continues its grammar's state."""
        if self.tokenizer is None:
            raise InvalidRequest(
                "grammar_needs_tokenizer", "this model has no tokenizer, so it cannot follow a grammar"
            )
        ids = prompt if isinstance(prompt, list) else []
        return self.grammars.matcher(grammar, ids[len(ids) - streamed_output :] if streamed_output else [])

    def _prepare_import(self, block: KVBlock) -> KVBlock:
        try:
            return transfer.for_cache(block, self.cache)
        except transfer.InvalidKVBlock as exc:
            raise InvalidRequest("invalid_kv_import", f"could not import KV: {exc}") from None

    def _admit(
        self,
        seq: Sequence,
        prompt: Prompt,
        tenant: str | None,
        export_kv: str | None,
        kv_import: KVBlock | None,
        streamed_output: int,
    ) -> None:
        """Validate and queue (under the lock); raises InvalidRequest."""
        params = seq.params
        if self.failed is not None:
            raise InvalidRequest(ENGINE_FAILED, self._failure_message())
        if seq.request_id in self._requests:
            raise InvalidRequest("duplicate_request_id", f"request id {seq.request_id!r} is already running")
        seq.prompt_ids = admission.prompt_ids(prompt, self.tokenizer, self.model.config.vocab_size)
        seq.max_tokens = admission.check(
            seq.prompt_ids,
            params,
            self.max_model_len,
            self.pages.capacity_tokens,
            has_tokenizer=self.tokenizer is not None,
            export_kv=export_kv,
            kv_import_tokens=None if kv_import is None else kv_import.num_tokens,
        )
        if not 0 <= streamed_output < len(seq.prompt_ids):
            raise InvalidRequest(
                "invalid_streamed_output",
                f"streamed_output counts prompt ids already streamed: 0 to {len(seq.prompt_ids) - 1}, "
                f"got {streamed_output}",
            )
        seq.arrival = next(self._arrivals)
        seq.table.salt = prefix_cache_salt(self._salt_secret, tenant)
        seq.export_kv, seq.kv_import, seq.streamed_output = export_kv, kv_import, streamed_output
        if params.seed is not None:
            seq.generator = torch.Generator()
        if self.tokenizer is not None:
            context = len(seq.prompt_ids) - streamed_output
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, stop=params.stop, prompt_ids=seq.prompt_ids[:context]
            )
            seq.detokenizer.push(seq.prompt_ids[context:])  # streamed already: only its held-back text stays
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self._work.notify_all()

    @staticmethod
    def _refuse(seq: Sequence, error: RequestError) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = "error"
        seq.error = error
        seq.emit([], "")

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> StreamEvent:
        seq.output_ids.append(token)
        logprobs = None if logprob is None else [logprob]
        text = ""
        reason = None
        grammar_done = grammar_failed = False
        if seq.matcher is not None:
            grammar_failed = not seq.matcher.consume_token(token)
            # A grammar that is complete allows nothing but end-of-sequence: the request stops there.
            grammar_done = seq.matcher.is_stopped()
        if grammar_failed:
            self._finish(
                seq,
                "error",
                RequestError("grammar_failed", f"the output left its grammar: {seq.matcher.get_error()}"),
            )
            return seq.deliver(seq.event([token], "", logprobs))
        if token in seq.params.stop_token_ids or (not seq.params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif seq.detokenizer is not None:
            text = seq.detokenizer.push([token])
            if seq.detokenizer.stopped:
                reason = "stop"
        if reason is None and grammar_done:
            reason = "stop"
        if reason is None and len(seq.output_ids) >= seq.max_tokens:
            reason = "length"
        # An exporting request that reached max_tokens continues elsewhere (add_request): what the
        # detokeniser holds back is the continuation's to release.
        continues = reason == "length" and seq.export_kv is not None
        if reason is not None:
            if seq.detokenizer is not None and not seq.detokenizer.stopped and not continues:
                text += seq.detokenizer.finish()
            self._finish(seq, reason)
        event = seq.event([token], text, logprobs)
        if seq.export_kv is not None and reason in ("stop", "length"):
            self._exports.append((seq, event))  # delivered once its KV is converted, after the lock
            return event
        return seq.deliver(event)

    def _finish(self, seq: Sequence, reason: str, error: RequestError | None = None) -> None:
        if seq.export_kv is not None and reason in ("stop", "length"):
            # A copy of the pages as stored (they are freed below); step() converts it outside the lock.
            seq.kv = transfer.read_pages(self.cache, seq.table.pages, seq.num_computed)
        seq.finish_reason = reason
        seq.error = error
        self.scheduler.finish(seq)
        self._requests.pop(seq.request_id, None)
        self._work.notify_all()

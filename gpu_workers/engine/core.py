"""The engine's core: requests admitted under one lock, and the step that schedules them, runs the model
once over the batch, samples, emits their events and frees their pages. ``engine.Engine`` is its public face.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid

import torch

from gpu_workers.engine import admission
from gpu_workers.engine.admission import Prompt
from gpu_workers.engine.failures import StepFailures, end_integrity_violations
from gpu_workers.engine.grammar import Grammars
from gpu_workers.engine.graphs import DecodeGraphs
from gpu_workers.engine.handoff import HandOff
from gpu_workers.engine.invariance import chunk_tokens
from gpu_workers.engine.loop import StepLoop
from gpu_workers.engine.params import (
    ENGINE_FAILED,
    EngineConfig,
    InvalidRequest,
    RequestError,
    SamplingParams,
    StreamEvent,
)
from gpu_workers.engine.runner import ModelRunner, build_cache
from gpu_workers.engine.sampling import sample_rows
from gpu_workers.engine.scheduler import ScheduledBatch, Scheduler
from gpu_workers.engine.sequence import Sequence
from gpu_workers.engine.stopping import append_token
from gpu_workers.kernels.packed_linear import PackedLinear
from gpu_workers.kv.integrity import IntegrityTracker
from gpu_workers.kv.manager import PageManager
from gpu_workers.kv.prefix_cache import PrefixCache, prefix_cache_salt
from gpu_workers.kv.transfer import KVBlock
from gpu_workers.protocol import TokenLogprob

log = logging.getLogger(__name__)


class EngineCore:
    """Continuous batching over a paged KV cache: admission, the step, and the end of requests. Thread-safe:
    any thread may add or step."""

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.dtype = config.compute_dtype
        self.model = model
        self.tokenizer = tokenizer
        self.packed_linears = sum(isinstance(m, PackedLinear) for m in model.modules())
        model_config = model.config
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        self.cache, num_pages = build_cache(model.kv_spec, config)
        self.pages = PageManager(
            num_pages,
            config.page_size,
            IntegrityTracker(num_pages, config.device) if config.integrity_check else None,
            PrefixCache() if config.prefix_cache else None,
        )
        self._salt_secret = config.prefix_cache_secret or os.urandom(32)
        chunk = (
            chunk_tokens(config.page_size, config.max_num_batched_tokens) if config.batch_invariant else None
        )
        self.scheduler = Scheduler(self.pages, config.max_num_seqs, config.max_num_batched_tokens, chunk)
        graphs = (
            DecodeGraphs(model, self.cache, config.max_num_seqs, self.max_model_len, config.device)
            if config.cuda_graphs
            else None
        )
        self.runner = ModelRunner(model, self.cache, config.device, graphs, config.batch_invariant)
        eos = set(model_config.eos_token_ids or [])
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.grammars = Grammars(tokenizer, sorted(eos), model.config.vocab_size)
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        # Unseeded requests draw from it where the logits are: sampling runs on the device.
        self._default_generator = torch.Generator(config.device).manual_seed(config.seed)
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._counters = {"steps": 0, "generated_tokens": 0, "computed_tokens": 0, "failed_steps": 0}
        self._failures = StepFailures(self._end)
        self._handoff = HandOff(self.cache)
        self._loop = StepLoop(self._work, self.step, self.scheduler.has_work, self._failures, self._crash)

    @property
    def failed(self) -> BaseException | None:
        """What stopped the engine for good; None while it serves."""
        return self._failures.failed

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
                self._counters["failed_steps"] += 1
                events = self._failures.step_failed(batch, exc, list(self._requests.values()))
            exports = self._handoff.take_held()
            failed_now = self.failed is not None
        # Converting exported KV is the costly part of a hand-off: outside the lock, so adds, aborts and
        # other threads' work never wait for it.
        events += [self._handoff.deliver(seq, event) for seq, event in exports]
        if failed_now:
            self._failures.notify()
        return events

    def _run(self, batch: ScheduledBatch) -> list[StreamEvent]:
        events = self._verify_integrity(batch) if self.config.integrity_check else []
        if not batch:
            return events
        events += self._handoff.copy_imports(batch, self._end)
        if not batch:
            return events
        rows, logits = self.runner.run(batch)
        self._counters["steps"] += 1
        self._counters["computed_tokens"] += sum(batch.num_new_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
            self.pages.publish(seq.table, seq.tokens, seq.num_computed)
        sampling = [batch.seqs[r] for r in rows]
        tokens, logprobs = sample_rows(logits, sampling, self.grammars, self._default_generator)
        events += [
            self._append_token(seq, token, logprob)
            for seq, token, logprob in zip(sampling, tokens, logprobs, strict=True)
        ]
        self._counters["generated_tokens"] += len(tokens)
        self._failures.succeeded()
        self._work.notify_all()
        return events

    def _verify_integrity(self, batch: ScheduledBatch) -> list[StreamEvent]:
        """One batched check of every page the step will read; abort only the sequences that fail it."""
        mismatches = self.pages.integrity.verify(
            [s.table.pages for s in batch.seqs], [s.table.generations for s in batch.seqs]
        )
        return end_integrity_violations(batch, mismatches, self._end) if mismatches else []

    def _crash(self, exc: BaseException) -> None:
        """Stop for good after a step raised past its own failure handling (the loop's last line)."""
        with self._lock:
            if self.failed is None:
                self._failures.stop(exc, list(self._requests.values()))
        self._failures.notify()

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
                kv_import = self._handoff.prepare_import(kv_import)
            if params.grammar is not None:  # outside the lock too: compiling a schema can take a while
                seq.matcher = admission.matcher(
                    self.grammars, self.tokenizer, params.grammar, prompt, streamed_output
                )
            with self._lock:
                self._admit(seq, prompt, tenant, export_kv, kv_import, streamed_output)
        except InvalidRequest as exc:
            admission.refuse(seq, RequestError(exc.code, exc.message))
        except Exception as exc:
            log.exception("request %s: could not be added", request_id)
            admission.refuse(
                seq,
                RequestError("internal_error", f"could not add the request ({type(exc).__name__}: {exc})"),
            )
        return seq

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
        if self.failed is not None:
            raise InvalidRequest(ENGINE_FAILED, self._failures.message())
        if seq.request_id in self._requests:
            raise InvalidRequest("duplicate_request_id", f"request id {seq.request_id!r} is already running")
        vocab, capacity = self.model.config.vocab_size, self.pages.capacity_tokens
        admission.prepare(
            seq,
            prompt,
            self.tokenizer,
            vocab,
            self.max_model_len,
            capacity,
            export_kv,
            kv_import,
            streamed_output,
        )
        seq.arrival = next(self._arrivals)
        seq.table.salt = prefix_cache_salt(self._salt_secret, tenant)
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self._work.notify_all()

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> StreamEvent:
        text, reason, error = append_token(seq, token, self.eos_token_ids)
        if reason is not None:
            self._finish(seq, reason, error)
        event = seq.event([token], text, None if logprob is None else [logprob])
        if self._handoff.exports(seq, reason):
            self._handoff.hold(seq, event)  # delivered once its KV is converted, after the lock
            return event
        return seq.deliver(event)

    def _finish(self, seq: Sequence, reason: str, error: RequestError | None = None) -> None:
        if self._handoff.exports(seq, reason):
            self._handoff.copy_export(seq)  # step() converts it outside the lock
        seq.finish_reason = reason
        seq.error = error
        self.scheduler.finish(seq)
        self._requests.pop(seq.request_id, None)
        self._work.notify_all()

    def _end(self, seqs: list[Sequence], error: RequestError) -> list[StreamEvent]:
        """End requests with ``error`` now; their final events."""
        events = []
        for seq in seqs:
            self._finish(seq, "error", error)
            events.append(seq.emit([], ""))
        return events

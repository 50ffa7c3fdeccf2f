"""Embedder: sentence embeddings from an encoder, batched across requests under a token budget.

No KV cache and no steps: an input is one forward pass. Waiting inputs (of every request) are sorted by
length and cut into batches of at most ``max_batch_inputs`` inputs and ``max_batch_tokens`` tokens; a batch
is packed end to end (``model.bert``), so only attention pads, and sorting keeps that padding small. A
server runs one background thread (``start``) that batches what the task threads ``submit``; offline
callers use ``embed``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu_workers.engine.dtype import resolve_dtype
from gpu_workers.engine.params import InvalidRequest
from gpu_workers.model.bert import BertModel
from gpu_workers.model.encoder_loader import load_encoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbedderConfig:
    dtype: str = "auto"  # bf16 where bf16 matmuls are fast (engine.dtype), else fp32
    device: str = "cpu"
    max_batch_inputs: int = 64  # inputs in one forward pass (a deployment's max_num_seqs)
    max_batch_tokens: int = 8192  # tokens in one forward pass; an input longer than this runs alone


class DeadlineExceeded(Exception):
    """The request's deadline passed before its inputs were embedded."""


@dataclass
class _Job:
    inputs: list[list[int]]
    deadline: float
    future: Future
    out: torch.Tensor | None = None
    remaining: int = 0
    failed: bool = False


@dataclass(order=True)
class _Item:
    length: int
    job: _Job | None = field(compare=False)  # None: an offline ``embed`` call
    index: int = field(compare=False)


class Embedder:
    """One encoder and the batches fed to it. Thread-safe: ``submit`` from any thread."""

    def __init__(self, model: BertModel, config: EmbedderConfig, dtype_reason: str = "requested"):
        if config.max_batch_inputs < 1 or config.max_batch_tokens < 1:
            raise ValueError("max_batch_inputs and max_batch_tokens must be at least 1")
        self.model = model
        self.config = config
        self.dtype_reason = dtype_reason
        self.device = torch.device(config.device)
        self._waiting: deque[_Item] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = {"requests": 0, "inputs": 0, "tokens": 0, "batches": 0}

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EmbedderConfig | None = None) -> Embedder:
        config = config or EmbedderConfig()
        choice = resolve_dtype(config.dtype, config.device)
        model = load_encoder(path, dtype=choice.torch_dtype, device=config.device)
        return cls(model, config, choice.reason)

    @property
    def dimension(self) -> int:
        return self.model.config.dimension

    @property
    def max_seq_length(self) -> int:
        return self.model.config.max_seq_length

    def stats(self) -> dict[str, int | str]:
        with self._wake:
            return {
                **self._stats,
                "waiting": len(self._waiting),
                "dtype": str(self._dtype()).removeprefix("torch."),
            }

    def _dtype(self) -> torch.dtype:
        return self.model.encoder.layer[0].output.dense.weight.dtype

    def check(self, inputs: list[list[int]]) -> None:
        """Raise InvalidRequest for inputs the model cannot embed (the gateway refuses them first)."""
        if not inputs:
            raise InvalidRequest("empty_input", "no inputs to embed")
        vocab, limit = self.model.config.vocab_size, self.max_seq_length
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequest("empty_input", f"input {i} has no tokens")
            if len(ids) > limit:
                raise InvalidRequest(
                    "context_length_exceeded",
                    f"input {i} has {len(ids)} tokens; this model takes at most {limit}",
                )
            if not all(0 <= t < vocab for t in ids):
                raise InvalidRequest("invalid_input", f"input {i} has token ids outside [0, {vocab})")

    # -- offline -------------------------------------------------------------------------------------

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """[len(inputs), dimension] fp32 vectors, in the inputs' order."""
        self.check(inputs)
        items = sorted(_Item(len(ids), None, i) for i, ids in enumerate(inputs))
        out = torch.empty(len(inputs), self.dimension)
        for batch in self._batches(items):
            vectors = self._forward([inputs[item.index] for item in batch])
            out[[item.index for item in batch]] = vectors
        return out

    def warm_up(self) -> float:
        """One throwaway batch, so oneDNN's primitives exist before a user's request; seconds taken."""
        started = time.perf_counter()
        self._forward([[0] * 8, [0] * 5])
        self._forward([[0] * 8])
        return time.perf_counter() - started

    def _batches(self, items: list[_Item]) -> list[list[_Item]]:
        batches: list[list[_Item]] = []
        batch: list[_Item] = []
        tokens = 0
        for item in items:
            too_many = len(batch) >= self.config.max_batch_inputs
            if batch and (too_many or tokens + item.length > self.config.max_batch_tokens):
                batches.append(batch)
                batch, tokens = [], 0
            batch.append(item)
            tokens += item.length
        if batch:
            batches.append(batch)
        return batches

    @torch.inference_mode()
    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([t for seq in inputs for t in seq], dtype=torch.long, device=self.device)
        vectors = self.model.embed(ids, [len(seq) for seq in inputs]).float().cpu()
        with self._wake:
            self._stats["batches"] += 1
            self._stats["inputs"] += len(inputs)
            self._stats["tokens"] += int(ids.numel())
        return vectors

    # -- serving -------------------------------------------------------------------------------------

    def submit(self, inputs: list[list[int]], deadline: float = float("inf")) -> Future:
        """A future of the inputs' [n, dimension] vectors, computed by the background thread with whatever
        else is waiting; it fails with InvalidRequest, DeadlineExceeded or the forward pass's error."""
        self.check(inputs)
        job = _Job(inputs, deadline, Future(), remaining=len(inputs))
        job.out = torch.empty(len(inputs), self.dimension)
        with self._wake:
            if self._thread is None or self._stopping:
                raise RuntimeError("the embedder is not running; call start() first")
            self._stats["requests"] += 1
            self._waiting.extend(_Item(len(ids), job, i) for i, ids in enumerate(inputs))
            self._wake.notify()
        return job.future

    def start(self) -> None:
        with self._wake:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="embedder", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish what was submitted, then stop the background thread."""
        with self._wake:
            thread, self._stopping = self._thread, True
            self._wake.notify()
        if thread is not None:
            thread.join()
        with self._wake:
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._stopping:
                    self._wake.wait()
                if not self._waiting:
                    return
                items = sorted(self._waiting)
                self._waiting.clear()
            now = time.time()
            live = []
            for item in items:
                job = item.job
                if job.failed:
                    continue
                if now >= job.deadline:
                    self._fail(
                        job, DeadlineExceeded("the request passed its deadline before it was embedded")
                    )
                    continue
                live.append(item)
            # Only the first batch runs now; the rest go back, to be sorted with what arrives meanwhile.
            batches = self._batches(live)
            if not batches:
                continue
            if len(batches) > 1:
                with self._wake:
                    self._waiting.extend(item for batch in batches[1:] for item in batch)
            self._run(batches[0])

    def _run(self, batch: list[_Item]) -> None:
        try:
            vectors = self._forward([item.job.inputs[item.index] for item in batch])
        except Exception as exc:  # the batch's requests fail; the embedder goes on with the next batch
            log.exception("an embedding batch of %d inputs failed", len(batch))
            for item in batch:
                self._fail(item.job, exc)
            return
        for row, item in enumerate(batch):
            job = item.job
            if job.failed:
                continue
            job.out[item.index] = vectors[row]
            job.remaining -= 1
            if job.remaining == 0:
                job.future.set_result(job.out)

    @staticmethod
    def _fail(job: _Job, error: BaseException) -> None:
        if not job.failed:
            job.failed = True
            job.future.set_exception(error)

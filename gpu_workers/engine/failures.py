"""Which step failures the engine survives: a failed step ends only its requests; the engine stops for good on
a device error (the accelerator's context is lost: every later step would fail too) or on a run of failed
steps, which says the fault is in the engine rather than in the requests it served. A request whose KV
pages fail the integrity check is ended alone, before the step reads them."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gpu_workers.engine.params import ENGINE_FAILED, RequestError, StreamEvent
from gpu_workers.engine.scheduler import ScheduledBatch
from gpu_workers.engine.sequence import Sequence
from gpu_workers.kv.integrity import Mismatch

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILED_STEPS = 3
# What CUDA/ROCm runtime, cuBLAS, cuDNN and NCCL errors say. Out-of-memory is absent on purpose: the failed
# step's requests free their pages and memory, and the next step can run.
DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "CUBLAS_STATUS_",
    "CUDNN_STATUS_",
    "HIP error",
    "NCCL error",
)

# Ends the given requests with an error, freeing their pages; returns their final events.
EndRequests = Callable[[list[Sequence], RequestError], list[StreamEvent]]


def is_device_error(exc: BaseException) -> bool:
    """True for errors after which the device cannot be trusted (torch raises most as AcceleratorError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in DEVICE_ERROR_MARKERS)


class StepFailures:
    """An engine's failed steps: counts them in a row, ends a failed step's requests, and stops the engine for
    good when it cannot go on (``failed`` holds the error; ``on_failure`` runs once, through ``notify``)."""

    def __init__(self, end: EndRequests, limit: int = MAX_CONSECUTIVE_FAILED_STEPS):
        self.end = end
        self.limit = limit
        self.consecutive = 0
        self.failed: BaseException | None = None  # what stopped the engine for good; None while it serves
        self.on_failure: Callable[[BaseException], None] | None = None

    def succeeded(self) -> None:
        self.consecutive = 0

    def step_failed(
        self, batch: ScheduledBatch | None, exc: Exception, requests: list[Sequence]
    ) -> list[StreamEvent]:
        """End the requests of a failed step (``batch``; None if the scheduler raised); stop the engine,
        ending every one of ``requests``, if it cannot go on."""
        self.consecutive += 1
        # A scheduler that raised left its queues half-updated: nothing it holds can be trusted.
        if is_device_error(exc) or self.consecutive >= self.limit or batch is None:
            log.critical("engine step failed; the engine cannot go on", exc_info=exc)
            return self.stop(exc, requests)
        unfinished = [seq for seq in batch.seqs if seq.finish_reason is None]
        log.error("engine step failed; failing the %d requests in it", len(unfinished), exc_info=exc)
        error = RequestError(
            "internal_error",
            f"the engine step serving this request failed ({type(exc).__name__}: {exc}); "
            "the request was stopped, other requests continue",
        )
        return self.end(unfinished, error)

    def stop(self, exc: BaseException, requests: list[Sequence]) -> list[StreamEvent]:
        """Stop for good: end every request, refuse new ones."""
        self.failed = exc
        return self.end(requests, RequestError(ENGINE_FAILED, self.message()))

    def message(self) -> str:
        return (
            f"the engine stopped after an error it cannot recover from ({type(self.failed).__name__}: "
            f"{self.failed}); retry the request"
        )

    def notify(self) -> None:
        """Run ``on_failure`` once (outside the engine's lock); what it raises is logged, the engine is down
        anyway."""
        callback, self.on_failure = self.on_failure, None
        if callback is None:
            return
        try:
            callback(self.failed)
        except Exception:
            log.exception("the engine's on_failure callback failed")


def end_integrity_violations(
    batch: ScheduledBatch, mismatches: list[Mismatch], end: EndRequests
) -> list[StreamEvent]:
    """End (and take out of the batch) every request with a page the integrity check found reallocated."""
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
        events += end([seq], error)
    return events

"""Which step failures the engine survives: a failed step ends only its requests; the engine stops for good on
a device error (the accelerator's context is lost: every later step would fail too) or on a run of failed
steps, which says the fault is in the engine rather than in the requests it served."""

from __future__ import annotations

import torch

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


def is_device_error(exc: BaseException) -> bool:
    """True for errors after which the device cannot be trusted (torch raises most as AcceleratorError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in DEVICE_ERROR_MARKERS)


class StepFailures:
    """Counts failed steps in a row; says when the engine must stop."""

    def __init__(self, limit: int = MAX_CONSECUTIVE_FAILED_STEPS):
        self.limit = limit
        self.consecutive = 0

    def succeeded(self) -> None:
        self.consecutive = 0

    def failed(self, exc: BaseException) -> bool:
        """Record a failed step; True if the engine cannot go on."""
        self.consecutive += 1
        return is_device_error(exc) or self.consecutive >= self.limit

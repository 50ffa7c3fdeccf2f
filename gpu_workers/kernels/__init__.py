"""Kernels for decode, each beside the torch reference it is tested against.

``name.py`` holds the reference and the function callers use; ``name_triton.py`` the Triton kernel with the
same signature, imported only when it runs; ``name_cpu.py`` a numba kernel for the CPU where one pays.
``backend`` names what work on a device runs ("triton" on CUDA tensors, "cpu": the numba kernels on CPU
tensors, else "reference"); ``use_triton`` and ``use_cpu_kernels`` are its two questions.
``TESSERA_KERNELS=reference`` forces the references everywhere; ``TESSERA_KERNELS=triton`` forces the
Triton kernels (on CPU that needs ``TRITON_INTERPRET=1``: how the tests run them).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from contextvars import ContextVar
from importlib.util import find_spec as _find_spec

import torch

KERNELS_ENV = "TESSERA_KERNELS"
KERNEL_MODES = ("auto", "reference", "triton")


@functools.cache
def find_spec(name: str):
    """``importlib.util.find_spec``, asked once per name: every norm and linear of a step asks whether the
    kernels' packages are installed, which does not change while a process runs."""
    return _find_spec(name)


# The mode as a step read it once (``one_mode``): the step's every linear, norm and activation asks.
_step_mode: ContextVar[str | None] = ContextVar("kernel_mode", default=None)


def kernel_mode() -> str:
    mode = _step_mode.get()
    return mode if mode is not None else _checked(os.environ.get(KERNELS_ENV, "auto"))


@contextlib.contextmanager
def one_mode() -> Iterator[None]:
    """Inside: ``kernel_mode`` as read on entry, not read from the environment again (a decode step asks it
    at every linear: ~1 us a read, ~2% of a small model's CPU step)."""
    token = _step_mode.set(kernel_mode())
    try:
        yield
    finally:
        _step_mode.reset(token)


def _checked(mode: str) -> str:
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV}={mode!r} is not a kernel mode; use one of {', '.join(KERNEL_MODES)}")
    return mode


def use_triton(device: torch.device) -> bool:
    """Whether work on ``device`` runs the Triton kernels (True) or the torch references (False)."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        return _triton_forced()
    return device.type == "cuda" and find_spec("triton") is not None


def _triton_forced() -> bool:
    if find_spec("triton") is None:
        raise RuntimeError(f"{KERNELS_ENV}=triton but triton is not installed: pip install triton")
    return True


def use_cpu_kernels(device: torch.device) -> bool:
    """Whether work on ``device`` runs the numba CPU kernels (``TESSERA_KERNELS=auto`` on a CPU tensor)."""
    return backend(device) == "cpu"


def backend(device: torch.device) -> str:
    """The kernels work on ``device`` runs: "triton", "cpu" (numba) or "reference" (torch). Asked by every
    norm and activation of a step: the answer is kept per device type and mode, only the mode read again."""
    mode = _step_mode.get()
    return _backend(device.type, mode if mode is not None else os.environ.get(KERNELS_ENV, "auto"))


@functools.cache
def _backend(device_type: str, mode: str) -> str:
    if _checked(mode) == "auto":
        if device_type == "cuda" and find_spec("triton") is not None:
            return "triton"
        if device_type == "cpu" and find_spec("numba") is not None:
            return "cpu"
        return "reference"
    return "triton" if mode == "triton" and _triton_forced() else "reference"


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on ``tensors``: the kernels record nothing, so such work (training)
    is the references'."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter, whose bf16 ``tl.dot`` is wrong: kernels then
    upcast dot operands to fp32 (ENVIRONMENT.md)."""
    import triton

    return bool(triton.knobs.runtime.interpret)

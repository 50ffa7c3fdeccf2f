"""Faults injected where a real one strikes: in the model's forward, which the engine calls inside its step.

``FaultyModel`` wraps a loaded model and, when a forward's input ids contain the trigger (a run of token
ids), runs a fault first: raise a device error (which then stays, as a lost CUDA context does), raise any
exception, sleep, or wait for an event the test sets. Everything else passes through to the real model. A
trigger of two or more ids fires only on a prompt that holds it: a decode step feeds one id per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

DEVICE_ERROR = "CUDA error: an illegal memory access was encountered"


class FaultyModel:
    def __init__(
        self,
        model,
        trigger: int | Sequence[int],
        fault: Callable[[], None],
        *,
        sticky: bool = False,
        once: bool = False,
    ):
        self.model = model
        self.trigger = [trigger] if isinstance(trigger, int) else list(trigger)
        self.fault = fault
        self.sticky = sticky  # once tripped, every later forward faults too
        self.once = once  # fault on the first forward with the trigger only
        self.tripped = threading.Event()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, positions, attention):
        ids_list, n = ids.tolist(), len(self.trigger)
        hit = any(ids_list[i : i + n] == self.trigger for i in range(len(ids_list) - n + 1))
        if (hit and not (self.once and self.tripped.is_set())) or (self.sticky and self.tripped.is_set()):
            self.tripped.set()
            self.fault()
        return self.model(ids, positions, attention)


def device_error() -> None:
    raise RuntimeError(DEVICE_ERROR)


def sleep(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)


def wait_for(event: threading.Event, timeout_s: float = 60.0) -> Callable[[], None]:
    return lambda: event.wait(timeout_s)

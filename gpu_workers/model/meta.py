"""Building a model on the meta device (no memory) without running its initialisers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# torch's initialisers that dispatch through torch function modes (the rest call these or none).
_INITIALISERS = frozenset({nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.constant_})


class _SkipInit(TorchFunctionMode):
    """Leaves a module's parameters as built while it is built: on the meta device there is nothing to
    initialise, and torch would run the initialisers' meta versions through its Python reference ops, whose
    first call imports torch._dynamo (~1.3 s of every worker's start, for random numbers nobody reads)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _INITIALISERS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside are empty shells on the meta device, to be given memory with ``to_empty``."""
    with torch.device("meta"), _SkipInit():
        yield

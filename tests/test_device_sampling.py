"""Sampling where the logits are: a step's [N, vocab] logits never come back to the host, only the token ids
and the logprobs asked for, in one small copy; and that path picks what the CPU picks, bit for bit.

There is no GPU here: ``SimulatedDevice`` runs every op on the CPU while the tensors it hands out stand for
a device's (they say 'meta'). It records each copy between host and device, each op that would make the
host wait for the device (a value read back, a nonzero), and each op handed a host tensor beside device
ones (on CUDA an error, or a hidden copy that waits). The engine runs as it does on a GPU: its logits are
made device tensors where the model computes them, and every step goes through the sampler's device path.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.protocol import Grammar

aten = torch.ops.aten

# Ops that read a device value back to the host before they can return.
WAITS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.equal.default,
    aten.is_nonzero.default,
}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class OnDevice(torch.Tensor):
    """A CPU tensor (``inner``) standing for one on a device; only ``SimulatedDevice`` computes with it, and
    it has no host memory to read (``tolist``, ``numpy`` fail)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device="meta",
        )

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __repr__(self):
        return f"OnDevice({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} on a simulated device tensor outside SimulatedDevice")


def _inner(x):
    return x.inner if isinstance(x, OnDevice) else x


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


class SimulatedDevice(TorchDispatchMode):
    """Runs ops on the CPU; a tensor made on 'meta', or computed from an ``OnDevice`` one, is ``OnDevice``.
    Records what crosses between host and device, and what would make the host wait."""

    def __init__(self):
        super().__init__()
        self.to_host: list[tuple[int, ...]] = []  # the shape of each device -> host copy
        self.to_device: list[bool] = []  # each host -> device copy: whether it was non_blocking
        self.waits: list[str] = []  # ops that read a device value on the host
        self.mixed: list[str] = []  # ops given host tensors beside device ones

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        names = [a.name for a in func._schema.arguments]
        bound = dict(zip(names, args, strict=False)) | (kwargs or {})
        tensors = [t for t in tree_leaves(list(bound.values())) if isinstance(t, torch.Tensor)]
        on_device = any(isinstance(t, OnDevice) for t in tensors)
        target = bound.get("device")
        made_on_device = _is_meta(target)
        if made_on_device:
            bound["device"] = torch.device("cpu")
        args = [bound.pop(name) for name in names[: len(args)]]
        moves = func.overloadpacket in (aten.to, aten._to_copy) and target is not None
        if moves and on_device and not made_on_device:
            self.to_host.append(tuple(args[0].shape))
            return func(*tree_map(_inner, args), **bound)  # a plain host tensor
        if moves and made_on_device and not on_device:
            self.to_device.append(bound.get("non_blocking", False))
        elif on_device:
            bool_index = func in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1])
            if func in WAITS or bool_index:
                self.waits.append(str(func))
            host = [tuple(t.shape) for t in tensors if not isinstance(t, OnDevice)]
            if host:
                self.mixed.append(f"{func} given host tensors {host}")
        out = func(*tree_map(_inner, args), **tree_map(_inner, bound))
        if not (on_device or made_on_device):
            return out
        first = func._schema.returns[0].alias_info if func._schema.returns else None
        if first is not None and first.is_write:  # in place: the device tensor it was given
            return args[0]
        return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) else t, out)


class HostGenerator(torch.Generator):
    """``torch.Generator``, except that one asked for on the simulated device is the CPU's."""

    def __new__(cls, device="cpu"):
        return torch._C.Generator("cpu" if _is_meta(device) else device)


@pytest.fixture
def simulated(monkeypatch):
    """Run a step as on a device: the logits the model computes are device tensors, and generators asked
    for on the device are the CPU's (so the draws are the CPU path's)."""

    def on_device(engine: Engine) -> SimulatedDevice:
        compute_logits = engine.model.compute_logits
        monkeypatch.setattr(engine.model, "compute_logits", lambda hidden: OnDevice(compute_logits(hidden)))
        monkeypatch.setattr(torch, "Generator", HostGenerator)
        return SimulatedDevice()

    return on_device


PROMPTS = [[5, 17, 33, 2, 90, 41, 8], [300, 301, 9], [44] * 5, [7, 8, 9, 10], [120, 121], [1000, 5, 6], [3]]
GRAMMAR = Grammar("regex", "[a-z ]{1,60}")


def requests() -> list[SamplingParams]:
    """One batch with every kind of row: greedy, seeded and unseeded draws, top-k/top-p, penalties,
    logprobs with and without top alternatives, and a grammar."""
    common = {"max_tokens": 6, "ignore_eos": True}
    return [
        SamplingParams(temperature=0, logprobs=3, **common),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=11, **common),
        SamplingParams(
            temperature=1.0, seed=12, frequency_penalty=0.7, repetition_penalty=1.3, logprobs=0, **common
        ),  # fmt: skip
        SamplingParams(temperature=0.8, **common),
        SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, **common),
        SamplingParams(temperature=0.7, seed=13, grammar=GRAMMAR, logprobs=2, **common),
        SamplingParams(temperature=0, presence_penalty=1.5, **common),
    ]


def generate(engine: Engine, mode: SimulatedDevice | None = None) -> tuple[list, int]:
    """Every request's (token ids, logprobs) and the number of steps that sampled."""
    outputs: dict[str, tuple[list, list]] = {}
    ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, requests(), strict=True)]
    for request_id in ids:
        outputs[request_id] = ([], [])
    steps = 0
    while engine.has_unfinished():
        with mode if mode is not None else contextlib.nullcontext():
            events = engine.step()
        steps += any(e.token_ids for e in events)
        for event in events:
            outputs[event.request_id][0].extend(event.token_ids)
            outputs[event.request_id][1].extend(event.logprobs or [])
    return [outputs[i] for i in ids], steps


def make_engine(path, cuda_graphs: bool) -> Engine:
    config = EngineConfig(dtype="float32", kv_budget_bytes=8 * 2**20, page_size=4, cuda_graphs=cuda_graphs)
    return Engine.from_pretrained(path, config)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graph-buffers"])
def test_a_step_copies_back_only_its_token_ids_and_logprobs(demo_model_dir, simulated, cuda_graphs):
    engine = make_engine(demo_model_dir, cuda_graphs)
    mode = simulated(engine)
    outputs, steps = generate(engine, mode)
    assert steps == 6 and all(len(tokens) == 6 for tokens, _ in outputs)
    # One copy back per step, never the [7, vocab] logits: 7 token ids, then for the 4 rows asking for
    # logprobs (3 top ones at most) their token's and top logprobs (4 x 4) and the top ids (4 x 3).
    assert mode.to_host == [(7 + 16 + 12,)] * steps
    assert mode.waits == [] and mode.mixed == []
    assert mode.to_device and all(mode.to_device)  # index and parameter copies queue without waiting
    if cuda_graphs:
        assert engine.runner.graphs.steps > 0


def test_the_device_path_picks_the_cpu_paths_tokens_and_logprobs(demo_model_dir, simulated):
    on_cpu, cpu_steps = generate(make_engine(demo_model_dir, cuda_graphs=False))
    device_engine = make_engine(demo_model_dir, cuda_graphs=False)
    on_device, device_steps = generate(device_engine, simulated(device_engine))
    assert on_device == on_cpu and device_steps == cpu_steps
    logprobs = [lps for _, lps in on_cpu]
    assert [len(lps[0].top) for lps in logprobs if lps] == [3, 0, 2, 2]

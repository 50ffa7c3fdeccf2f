"""How far a quantised model is from its reference: per-layer relative error, logit KL, top-1 agreement and
perplexity, over the same token windows.

Per-layer error is isolated: each quantised linear layer gets exactly the input its reference layer got
(the reference's forward pass), so one layer's number does not include error from the layers before it.
Text runs in windows that start at position 0, each one whole-prompt prefill through the paged cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.kv.attention import AttentionMetadata, PagedAttention
from gpu_workers.kv.cache import KVCache
from gpu_workers.quant.config import DEFAULT_NOT_CONVERTED, converts

PAGE_SIZE = 16


def token_windows(sequences: list[list[int]], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """``sequences`` cut into windows of at most ``window`` tokens, the first ``max_tokens`` tokens in all."""
    chunks = [seq[i : i + window] for seq in sequences for i in range(0, len(seq), window)]
    kept, left = [], max_tokens if max_tokens is not None else sum(map(len, chunks))
    for chunk in chunks:
        if left <= 0:
            break
        if len(chunk) > 1:  # a one-token window predicts nothing
            kept.append(chunk[:left])
            left -= len(kept[-1])
    return kept


@torch.inference_mode()
def run_windows(
    model: torch.nn.Module, windows: list[list[int]]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (token ids [T], final hidden states [T, hidden]) for each window."""
    device = next(model.parameters()).device
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    longest = max(map(len, windows), default=0)
    num_pages = -(-longest // PAGE_SIZE)
    cache = KVCache(model.kv_spec, num_pages, PAGE_SIZE, dtype, device)
    table = list(range(num_pages))
    for window in windows:
        meta = AttentionMetadata.build([table], [len(window)], [len(window)], PAGE_SIZE, device)
        ids = torch.tensor(window, dtype=torch.long, device=device)
        positions = torch.arange(len(window), device=device)
        yield ids, model(ids, positions, PagedAttention(cache, meta))


@dataclass
class QualityReport:
    tokens: int  # positions compared
    kl: float  # mean KL(reference || candidate) of next-token distributions, nats
    top1: float  # fraction of positions where both models' most likely next token agree
    nll: float  # candidate's mean next-token negative log-likelihood, nats
    reference_nll: float
    layer_errors: dict[str, float] = field(default_factory=dict)  # linear layer → ||Δy|| / ||y||

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(self.reference_nll)


@torch.inference_mode()
def compare_models(reference: nn.Module, candidate: nn.Module, windows: list[list[int]]) -> QualityReport:
    """Run both models (distinct module objects) over ``windows`` and compare them."""
    sums: dict[str, list[float]] = {}
    hooks = []
    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear) and converts(name, DEFAULT_NOT_CONVERTED):
            sums[name] = [0.0, 0.0]
            hooks.append(
                module.register_forward_hook(_layer_error(candidate.get_submodule(name), sums[name]))
            )
    kl = agree = nll = ref_nll = 0.0
    tokens = 0
    try:
        for (ids, ref_hidden), (_, cand_hidden) in zip(
            run_windows(reference, windows), run_windows(candidate, windows), strict=True
        ):
            ref_logp = F.log_softmax(reference.compute_logits(ref_hidden)[:-1].float(), dim=-1)
            cand_logp = F.log_softmax(candidate.compute_logits(cand_hidden)[:-1].float(), dim=-1)
            targets = ids[1:]
            kl += (ref_logp.exp() * (ref_logp - cand_logp)).sum().item()
            agree += (ref_logp.argmax(-1) == cand_logp.argmax(-1)).sum().item()
            nll -= cand_logp.gather(1, targets[:, None]).sum().item()
            ref_nll -= ref_logp.gather(1, targets[:, None]).sum().item()
            tokens += len(targets)
    finally:
        for hook in hooks:
            hook.remove()
    if tokens == 0:
        raise ValueError("no tokens to compare: the sample text is empty")
    errors = {name: math.sqrt(diff / max(ref, 1e-30)) for name, (diff, ref) in sums.items()}
    return QualityReport(tokens, kl / tokens, agree / tokens, nll / tokens, ref_nll / tokens, errors)


def _layer_error(candidate: nn.Module, acc: list[float]):
    def hook(_module, args, output):
        diff = candidate(args[0]).float() - output.float()
        acc[0] += diff.pow(2).sum().item()
        acc[1] += output.float().pow(2).sum().item()

    return hook

"""Quality metrics, in one place: next-token NLL, KL(reference || candidate) and top-1 agreement per position
(``next_token_metrics``, shared with ``tessera eval quality``), and how far a quantised model is from its
reference (``compare_models``: those metrics plus per-layer relative error, over the same token windows).

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

from gpu_workers.engine.runner import forward_sequence, sequence_cache
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
    """Yield (token ids [T], final hidden states [T, hidden]) for each window, each one whole prefill."""
    cache, pages = sequence_cache(model, max(map(len, windows), default=0), PAGE_SIZE)
    for window in windows:
        yield torch.tensor(window, dtype=torch.long), forward_sequence(model, cache, pages, window)


@dataclass
class NextTokenMetrics:
    """Per position: the candidate's NLL of the true next token, KL(reference || candidate), top-1 agreement."""

    nll: torch.Tensor  # [T] nats
    kl: torch.Tensor  # [T] nats, clamped at 0 (rounding can make it slightly negative)
    top1: torch.Tensor  # [T] bool


def next_token_metrics(
    reference_logp: torch.Tensor, candidate_logp: torch.Tensor, targets: torch.Tensor
) -> NextTokenMetrics:
    """Metrics from two float32 log-softmax tensors [T, vocab] and the true next tokens [T]."""
    return NextTokenMetrics(
        nll=-candidate_logp.gather(1, targets[:, None].to(candidate_logp.device)).squeeze(1),
        kl=(reference_logp.exp() * (reference_logp - candidate_logp)).sum(-1).clamp_min(0),
        top1=reference_logp.argmax(-1) == candidate_logp.argmax(-1),
    )


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
            m = next_token_metrics(ref_logp, cand_logp, targets)
            kl += m.kl.sum().item()
            agree += m.top1.sum().item()
            nll += m.nll.sum().item()
            ref_nll += next_token_metrics(ref_logp, ref_logp, targets).nll.sum().item()
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

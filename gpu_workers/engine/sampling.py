"""Turn a batch of next-token logits into tokens: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from gpu_workers.engine.params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of ``logits`` [N, vocab] (float32).

    Each row draws from its own generator, so a seeded request picks the same tokens whatever else is
    in the batch.
    """
    if not params:
        return []
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    tokens = greedy.tolist()
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows)
    probs = _filtered_probs(logits[rows], [params[i] for i in sampled_rows])
    for j, i in enumerate(sampled_rows):
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one generator call per row.
        noise = torch.empty_like(probs[j]).exponential_(generator=generators[i])
        tokens[i] = int((probs[j] / noise).argmax())
    return tokens


def position_seed(seed: int, position: int) -> int:
    """Mix a request seed and a token position into a generator seed (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1  # manual_seed takes a non-negative 63-bit value


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)[:, None]
    scaled = logits / temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab)[None, :]
    drop = rank >= top_k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)

"""Turn a batch of next-token logits into tokens: repetition penalties, greedy, temperature, top-k, top-p,
per-request seeds; and the log-probabilities of what was picked. ``sample_rows`` does it all for a step's
requests."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from gpu_workers.engine import sequence
from gpu_workers.engine.grammar import Grammars
from gpu_workers.engine.params import SamplingParams
from gpu_workers.protocol import LOGPROB_FLOOR, TokenLogprob

# A row's token history: (prompt ids, ids generated so far in this request).
History = tuple[Sequence[int], Sequence[int]]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    histories: Sequence[History] | None = None,
) -> list[int]:
    """One token per row of ``logits`` [N, vocab] (float32).

    Each row draws from its own generator, so a seeded request picks the same tokens whatever else is
    in the batch. Rows that ask for a penalty have it applied first (``histories`` gives their tokens);
    greedy rows take the argmax; sampled rows are sorted only when top-k or top-p asks.
    """
    if not params:
        return []
    if histories is not None:
        logits = apply_penalties(logits, params, histories)
    tokens = first_argmax(logits)
    sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows)
    probs = _probs(logits[rows], [params[i] for i in sampled_rows])
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Rows sharing a generator (every
    # unseeded request draws from the engine's) take their noise in one call, in row order.
    noise = torch.empty_like(probs)
    by_generator: dict[int, list[int]] = {}
    for j, i in enumerate(sampled_rows):
        by_generator.setdefault(id(generators[i]), []).append(j)
    for members in by_generator.values():
        generator = generators[sampled_rows[members[0]]]
        if len(members) == 1:
            noise[members[0]].exponential_(generator=generator)
        else:
            noise[members] = torch.empty(len(members), probs.shape[1]).exponential_(generator=generator)
    for j, token in enumerate(first_argmax(probs / noise)):
        tokens[sampled_rows[j]] = token
    return tokens


def token_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> list[TokenLogprob | None]:
    """For each row that asks (``params.logprobs`` not None), the log-probability of its token and of its
    most likely tokens under the distribution it was sampled from: softmax(logits / temperature) after
    top-k/top-p for sampled rows, softmax(logits) for greedy ones. ``logits`` are the ones sampled from,
    penalties and masks applied. None for the other rows; they cost nothing."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    picked = logits[rows]
    logprobs = torch.empty_like(picked)
    greedy = [j for j, i in enumerate(rows) if params[i].temperature == 0]
    sampled = [j for j, i in enumerate(rows) if params[i].temperature > 0]
    if greedy:
        logprobs[greedy] = picked[greedy].log_softmax(dim=-1)
    if sampled:
        logprobs[sampled] = _probs(picked[sampled], [params[rows[j]] for j in sampled]).log()
    logprobs = logprobs.clamp(min=LOGPROB_FLOOR)
    chosen = logprobs[torch.arange(len(rows)), torch.tensor([tokens[i] for i in rows])].tolist()
    k = max(params[i].logprobs for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs
        top = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        out[i] = TokenLogprob(tokens[i], chosen[j], top)
    return out


def first_argmax(x: torch.Tensor) -> list[int]:
    """Each row's first maximal index (a NaN counts as the maximum, as in torch's ``max``). On the CPU numpy's
    SIMD argmax of fp32: 15-19 vs 150-176 µs for torch's ``max(dim=-1).indices`` at 32 x 4096 (torch's
    ``argmax`` is as slow), the same indices."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return x.detach().contiguous().numpy().argmax(axis=-1).tolist()
    return x.max(dim=-1).indices.tolist()


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution: softmax(logits / temperature), filtered where top-k/top-p ask."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    scaled = logits / temperature
    filtered = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
    if not filtered:
        return scaled.softmax(dim=-1)
    probs = scaled.softmax(dim=-1)
    probs[filtered] = _filtered_probs(scaled[filtered], [params[j] for j in filtered])
    return probs


def position_seed(seed: int, position: int) -> int:
    """Mix a request seed and a token position into a generator seed (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1  # manual_seed takes a non-negative 63-bit value


def _filtered_probs(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k then top-p over temperature-scaled logits: one sort per row."""
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=scaled.dtype)[:, None]
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


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History]
) -> torch.Tensor:
    """``logits`` with each row's repetition penalties applied, as vLLM orders them: first
    ``repetition_penalty`` over the tokens of the prompt and the output (positive logits divided by it,
    negative ones multiplied), then ``logit[t] -= frequency_penalty * count[t] + presence_penalty *
    (count[t] > 0)`` with counts over the output. Only rows that ask for a penalty are touched, and in
    them only the logits of tokens they hold (gathered and scattered back; a token seen twice gets the
    same value twice); ``logits`` itself is left as it was."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    picked = [params[i] for i in rows]
    penalised = logits[rows]
    rep_rows = [j for j, p in enumerate(picked) if p.repetition_penalty != 1.0]
    if rep_rows:
        r, t = _flat_ids([h for j in rep_rows for h in histories[rows[j]]], vocab)
        r = torch.tensor(rep_rows)[r // 2]  # two lists (prompt, output) per row
        rep = torch.tensor([p.repetition_penalty for p in picked], dtype=logits.dtype)[r]
        seen = penalised[r, t]
        penalised[r, t] = torch.where(seen > 0, seen / rep, seen * rep)
    r, t = _flat_ids([histories[i][1] for i in rows], vocab)
    if len(t):
        counts = torch.zeros(len(rows), vocab, dtype=logits.dtype)
        counts.index_put_((r, t), torch.ones(len(t), dtype=logits.dtype), accumulate=True)
        freq = torch.tensor([p.frequency_penalty for p in picked], dtype=logits.dtype)[r]
        pres = torch.tensor([p.presence_penalty for p in picked], dtype=logits.dtype)[r]
        penalised[r, t] = penalised[r, t] - (freq * counts[r, t] + pres)
    return logits.index_copy(0, torch.tensor(rows), penalised)


def _flat_ids(id_lists: list[Sequence[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every id in ``id_lists`` that is a valid index into ``vocab``, as two int64
    tensors; built through one ``array`` (a list of ints converts several times faster that way)."""
    flat = array("q")
    lengths = []
    for ids in id_lists:
        flat.extend(ids)
        lengths.append(len(ids))
    if not flat:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty
    ids = torch.frombuffer(flat, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), torch.tensor(lengths))
    valid = (ids >= 0) & (ids < vocab)
    return rows[valid], ids[valid]


def sample_rows(
    logits: torch.Tensor, seqs: list[sequence.Sequence], grammars: Grammars, default: torch.Generator
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The next token of each request (a row of ``logits``) and its logprob: grammar masks, penalties, then
    sampling. A seeded request draws from a generator keyed by (seed, position of the token being sampled),
    so its tokens do not depend on batching, preemption, or which pool sampled the earlier ones; the others
    from ``default``."""
    params = [s.params for s in seqs]
    logits = grammars.mask(logits, [s.matcher for s in seqs])
    logits = apply_penalties(
        logits, params, [s.history() if s.params.has_penalties else ((), ()) for s in seqs]
    )
    generators = [
        default
        if s.generator is None
        else s.generator.manual_seed(position_seed(s.params.seed, s.num_tokens))
        for s in seqs
    ]
    tokens = sample(logits, params, generators)
    return tokens, token_logprobs(logits, params, tokens)

"""Turn a batch of next-token logits into tokens where the logits are: repetition penalties, greedy,
temperature, top-k, top-p, per-request seeds; and the log-probabilities of what was picked. ``sample_rows``
does it all for a step's requests and brings back to the host only their token ids and the logprobs they
asked for, in one small copy: on a GPU the [N, vocab] logits never leave the device."""

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
) -> torch.Tensor:
    """One token id per row of ``logits`` [N, vocab] (float32), int64 on their device.

    Each row draws from its own generator (on the logits' device), so a seeded request picks the same
    tokens whatever else is in the batch. Rows that ask for a penalty have it applied first (``histories``
    gives their tokens); greedy rows take the argmax; sampled rows are sorted only when top-k or top-p asks.
    """
    if histories is not None:
        logits = apply_penalties(logits, params, histories)
    sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not sampled_rows:
        return first_argmax(logits)
    every_row = len(sampled_rows) == len(params)
    rows = None if every_row else to_device(sampled_rows, logits.device)
    probs = _probs(logits if every_row else logits[rows], [params[i] for i in sampled_rows])
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
        elif len(members) == len(sampled_rows):
            noise.exponential_(generator=generator)
        else:
            drawn = torch.empty(len(members), probs.shape[1], device=probs.device)
            noise[to_device(members, probs.device)] = drawn.exponential_(generator=generator)
    drawn_tokens = first_argmax(probs / noise)
    if every_row:
        return drawn_tokens
    return first_argmax(logits).index_copy_(0, rows, drawn_tokens)


def token_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of each row's token and of its most likely tokens, on the logits' device:
    [N, 1 + k] float32 (the token's, then the top k, most likely first) and the top tokens' ids [N, k]
    int64, k the most any row asks for (``params.logprobs``); ``read_logprobs`` makes them TokenLogprobs on
    the host. Each under the distribution its token was drawn from: softmax(logits / temperature) after
    top-k/top-p for sampled rows, softmax(logits) for greedy ones. ``logits`` are the ones sampled from,
    penalties and masks applied."""
    greedy = [j for j, p in enumerate(params) if p.temperature == 0]
    if len(greedy) == len(params):
        logprobs = logits.log_softmax(dim=-1)
    elif not greedy:
        logprobs = _probs(logits, params).log()
    else:
        sampled = [j for j, p in enumerate(params) if p.temperature > 0]
        greedy_rows, sampled_rows = to_device(greedy, logits.device), to_device(sampled, logits.device)
        logprobs = torch.empty_like(logits)
        logprobs[greedy_rows] = logits[greedy_rows].log_softmax(dim=-1)
        logprobs[sampled_rows] = _probs(logits[sampled_rows], [params[j] for j in sampled]).log()
    logprobs = logprobs.clamp(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(1, tokens[:, None])
    k = max(p.logprobs for p in params)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return torch.cat([chosen, top_values], dim=1), top_ids


def read_logprobs(
    values: list[float], top_ids: list[int], params: list[SamplingParams], tokens: list[int]
) -> list[TokenLogprob]:
    """``token_logprobs``' two tensors, flattened on the host, as each row's TokenLogprob."""
    k = max(p.logprobs for p in params)
    out = []
    for j, (p, token) in enumerate(zip(params, tokens, strict=True)):
        row = values[j * (k + 1) : (j + 1) * (k + 1)]
        top = list(zip(top_ids[j * k : j * k + p.logprobs], row[1 : 1 + p.logprobs], strict=True))
        out.append(TokenLogprob(token, row[0], top))
    return out


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index (a NaN counts as the maximum, as in torch's ``max``), int64 on ``x``'s
    device. On the CPU numpy's SIMD argmax of fp32: 15-19 vs 150-176 µs for torch's ``max(dim=-1).indices``
    at 32 x 4096 (torch's ``argmax`` is as slow), the same indices."""
    if x.is_cpu and x.dtype == torch.float32:
        return torch.from_numpy(x.detach().contiguous().numpy().argmax(axis=-1))
    return x.max(dim=-1).indices


def to_device(
    values: list | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """Host values (a list, or a tensor on the CPU) as a tensor on ``device``. Onto a GPU from pinned memory
    without waiting: a plain copy to CUDA blocks until the device has run all it was given (the step's
    forward), while this one queues behind it."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host(small: torch.Tensor) -> torch.Tensor:
    """``small`` on the host: a step's one copy back, and its one wait (the scheduler needs the token ids).
    From CUDA into pinned memory, queued behind the step's work; the wait is for that queue."""
    if small.is_cpu:
        return small
    if not small.is_cuda:
        return small.cpu()
    host = torch.empty(small.shape, dtype=small.dtype, pin_memory=True)
    host.copy_(small, non_blocking=True)
    torch.cuda.current_stream(small.device).synchronize()
    return host


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution: softmax(logits / temperature), filtered where top-k/top-p ask."""
    vocab = logits.shape[-1]
    temperature = to_device([p.temperature for p in params], logits.device, logits.dtype)[:, None]
    scaled = logits / temperature
    filtered = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
    if not filtered:
        return scaled.softmax(dim=-1)
    if len(filtered) == len(params):
        return _filtered_probs(scaled, params)
    rows = to_device(filtered, logits.device)
    probs = scaled.softmax(dim=-1)
    probs[rows] = _filtered_probs(scaled[rows], [params[j] for j in filtered])
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
    top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], scaled.device)[:, None]
    top_p = to_device([p.top_p for p in params], scaled.device, scaled.dtype)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
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
    same value twice); ``logits`` itself is left as it was. The token ids are gathered on the host and
    copied to the logits' device."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[-1]
    picked = [params[i] for i in rows]
    index = to_device(rows, device)
    penalised = logits[index]
    rep_rows = [j for j, p in enumerate(picked) if p.repetition_penalty != 1.0]
    if rep_rows:
        r, t = _flat_ids([h for j in rep_rows for h in histories[rows[j]]], vocab)
        r = torch.tensor(rep_rows)[r // 2]  # two lists (prompt, output) per row
        rep = torch.tensor([p.repetition_penalty for p in picked], dtype=dtype)[r]
        r, t, rep = to_device(r, device), to_device(t, device), to_device(rep, device)
        seen = penalised[r, t]
        penalised[r, t] = torch.where(seen > 0, seen / rep, seen * rep)
    r, t = _flat_ids([histories[i][1] for i in rows], vocab)
    if len(t):
        freq = torch.tensor([p.frequency_penalty for p in picked], dtype=dtype)[r]
        pres = torch.tensor([p.presence_penalty for p in picked], dtype=dtype)[r]
        r, t, freq, pres = (to_device(x, device) for x in (r, t, freq, pres))
        counts = torch.zeros(len(rows), vocab, dtype=dtype, device=device)
        counts.index_put_((r, t), torch.ones(len(t), dtype=dtype, device=device), accumulate=True)
        penalised[r, t] = penalised[r, t] - (freq * counts[r, t] + pres)
    return logits.index_copy(0, index, penalised)


def _flat_ids(id_lists: list[Sequence[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every id in ``id_lists`` that is a valid index into ``vocab``, as two int64
    tensors on the host; built through one ``array`` (a list of ints converts several times faster that
    way)."""
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
    """The next token of each request (a row of ``logits``) and its logprob: grammar masks, penalties,
    sampling and logprobs on the logits' device, then one copy of the token ids and logprobs to the host.
    A seeded request draws from a generator keyed by (seed, position of the token being sampled), so its
    tokens do not depend on batching, preemption, or which pool sampled the earlier ones; the others from
    ``default`` (on the logits' device)."""
    if not seqs:
        return [], []
    params = [s.params for s in seqs]
    logits = grammars.mask(logits, [s.matcher for s in seqs])
    logits = apply_penalties(
        logits, params, [s.history() if s.params.has_penalties else ((), ()) for s in seqs]
    )
    generators = [default if s.generator is None else _seeded(s, logits.device) for s in seqs]
    tokens = sample(logits, params, generators)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not asking:
        return to_host(tokens).tolist(), [None] * len(seqs)
    asked = [params[i] for i in asking]
    if len(asking) == len(seqs):
        values, top_ids = token_logprobs(logits, asked, tokens)
    else:
        rows = to_device(asking, logits.device)
        values, top_ids = token_logprobs(logits[rows], asked, tokens[rows])
    # The step's one copy: token ids, the logprobs' float32 bits and their top ids, as one int32 tensor.
    host = to_host(torch.cat([tokens.int(), values.flatten().view(torch.int32), top_ids.flatten().int()]))
    n, m = len(seqs), values.numel()
    token_ids = host[:n].tolist()
    logprobs: list[TokenLogprob | None] = [None] * n
    read = read_logprobs(
        host[n : n + m].view(torch.float32).tolist(),
        host[n + m :].tolist(),
        asked,
        [token_ids[i] for i in asking],
    )
    for i, logprob in zip(asking, read, strict=True):
        logprobs[i] = logprob
    return token_ids, logprobs


def _seeded(seq: sequence.Sequence, device: torch.device) -> torch.Generator:
    """A seeded request's generator on ``device`` (moved there on first use), seeded for the position of
    the token being sampled."""
    if seq.generator.device != device:
        seq.generator = torch.Generator(device)
    return seq.generator.manual_seed(position_seed(seq.params.seed, seq.num_tokens))

"""Batch-invariant execution (``EngineConfig.batch_invariant``): a seeded request's tokens and logprobs are the
same bits alone, in a crowd that splits its prefill differently, and after a prefix-cache hit; the pieces that
make it so (padded linears, fixed chunks, chunk-aligned hits) each hold their own rule."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.engine.invariance import MIN_ROWS, PaddedLinears, chunk_tokens
from tests.test_gguf import smollm2_path

SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)


def _run(engine: Engine, tenant: str, before: list[list[int]], prompt: list[int], after: list[list[int]]):
    """``prompt``'s tokens, logprobs and cached-token count, run for ``tenant`` (its prefix cache) among
    ``before`` and ``after`` (added first and last, all at once)."""
    ids = [engine.add_request(p, SAMPLED, tenant=tenant) for p in [*before, prompt, *after]]
    wanted = ids[len(before)]
    tokens: list[int] = []
    logprobs: list[float] = []
    cached = 0
    while engine.has_unfinished():
        for event in engine.step():
            if event.request_id == wanted:
                tokens += event.token_ids
                logprobs += [lp.logprob for lp in event.logprobs or []]
                cached = max(cached, event.cached_tokens)
    return tokens, logprobs, cached


# INT8 KV, the default decode format: where the default engine's chunk boundaries move logits most (a later
# chunk reads the earlier ones' KV quantised).
@pytest.mark.slow
def test_a_seeded_request_is_the_same_bits_alone_among_others_and_from_the_prefix_cache():
    engine = Engine.from_pretrained(
        smollm2_path(),
        EngineConfig(
            dtype="float32",
            kv_cache_dtype="int8",
            batch_invariant=True,
            max_num_batched_tokens=256,
            kv_budget_bytes=48 * 2**20,
        ),
    )
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(300)]
    others = [[rng.randrange(100, 40000) for _ in range(rng.randrange(50, 200))] for _ in range(15)]
    alone = _run(engine, "alone", [], prompt, [])
    # Seven prompts ahead of it take most of the first steps' budget, so the default engine would cut its
    # prefill elsewhere than alone (measured: logprobs moved by up to 0.035 with int8 KV), and fifteen
    # decode beside it.
    crowd = _run(engine, "crowd", others[:7], prompt, others[7:])
    # 200 tokens of it cached by an earlier prompt (12 full pages): the default engine would compute only the
    # tail, from 192.
    engine.add_request([*prompt[:200], 5, 6, 7], SamplingParams(max_tokens=1), tenant="hit")
    while engine.has_unfinished():
        engine.step()
    hit = _run(engine, "hit", others[:2], prompt, others[2:4])
    assert len(alone[1]) == len(alone[0]) == SAMPLED.max_tokens
    assert crowd[:2] == alone[:2] and crowd[2] == 0
    assert hit[:2] == alone[:2]
    chunk = chunk_tokens(16, 256)
    assert hit[2] == 200 // chunk * chunk > 0  # the hit, taken up to a chunk boundary


def test_padded_linears_compute_few_rows_as_a_gemm_of_min_rows_does():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 80), torch.randn(96)
    x = torch.randn(1, 3, 80)  # three rows, behind a leading dimension
    with PaddedLinears():
        padded = F.linear(x, weight, bias)
    full = F.linear(torch.cat([x.reshape(3, 80), torch.zeros(MIN_ROWS - 3, 80)]), weight, bias)[:3]
    assert padded.shape == (1, 3, 96)
    assert torch.equal(padded.reshape(3, 96), full)


def test_padded_linears_compute_many_rows_in_blocks_of_min_rows():
    """Every row comes out of a GEMM of MIN_ROWS rows, so a row has the same bits in a batch of 16, 37 or 600
    (with two threads, MKL splits the sum over K of a 600-row call of this shape otherwise)."""
    torch.manual_seed(0)
    weight = torch.randn(576, 1536)
    x = torch.randn(600, 1536)
    with PaddedLinears():
        alone = F.linear(x[:MIN_ROWS], weight)
        for rows in (37, 64, 100, 600):
            out = F.linear(x[:rows], weight)
            assert out.shape == (rows, 576)
            assert torch.equal(out[:MIN_ROWS], alone)
        # a row's place in its block does not move it
        assert torch.equal(F.linear(x[5 : 5 + MIN_ROWS], weight)[0], alone[5])


def test_the_fixed_chunk_is_whole_pages_and_fits_beside_decoding_rows():
    assert chunk_tokens(16, 1024) == 256
    assert chunk_tokens(16, 256) == 128
    assert chunk_tokens(16, 40) == 16
    assert chunk_tokens(4, 64) == 32
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 32"):
        EngineConfig(batch_invariant=True, page_size=16, max_num_batched_tokens=24)

"""Token log-probabilities: the log-softmax of the distribution each token was drawn from, against
transformers' logits of the same tokens; top alternatives; sampling filters, penalties and grammars."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.engine.params import InvalidRequest
from gpu_workers.engine.sampling import read_logprobs, token_logprobs
from gpu_workers.protocol import LOGPROB_FLOOR

PROMPT = [5, 17, 33, 2, 90, 41, 8]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    config = EngineConfig(dtype="float32", kv_budget_bytes=4 * 2**20, page_size=4, max_num_batched_tokens=64)
    return Engine.from_pretrained(tiny_llama_dir, config)


def run(engine: Engine, params: SamplingParams) -> list:
    events = []
    engine.add_request(PROMPT, params, on_event=events.append)
    while engine.has_unfinished():
        engine.step()
    return [lp for e in events for lp in e.logprobs or ()]


def logprobs_of(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list:
    """The TokenLogprobs of ``tokens`` (one a row), read on the host as the sampler reads them."""
    values, top_ids = token_logprobs(logits, params, torch.tensor(tokens))
    return read_logprobs(values.flatten().tolist(), top_ids.flatten().tolist(), params, tokens)


def test_greedy_logprobs_are_the_log_softmax_of_transformers_logits(tiny_llama_dir, engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    logprobs = run(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5))
    tokens = [lp.token for lp in logprobs]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    expected = logits.log_softmax(-1)
    assert len(logprobs) == 6
    for i, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(expected[i, lp.token].item(), abs=1e-4)
        values, ids = expected[i].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert lp.top[0][0] == lp.token  # greedy takes the most likely token


def test_top_logprobs_zero_gives_the_token_alone_and_none_gives_nothing(engine):
    alone = run(engine, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0))
    assert len(alone) == 3 and all(lp.top == [] and lp.logprob <= 0 for lp in alone)
    assert run(engine, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) == []


def test_sampled_logprobs_follow_temperature_and_top_k():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=4),
        SamplingParams(temperature=2.0, logprobs=2),
    ]
    first, second = logprobs_of(logits, params, [int(logits[0].argmax()), 7])
    # Only three tokens can be drawn at top_k=3: their probabilities sum to one, the fourth is ruled out.
    assert math.fsum(math.exp(v) for _, v in first.top[:3]) == pytest.approx(1.0, abs=1e-5)
    assert first.top[3][1] == LOGPROB_FLOOR
    expected = (logits[0] / 0.5).topk(3).values.log_softmax(-1)
    assert [v for _, v in first.top[:3]] == pytest.approx(expected.tolist(), abs=1e-5)
    assert second.logprob == pytest.approx((logits[1] / 2.0).log_softmax(-1)[7].item(), abs=1e-5)


def test_logprobs_are_taken_after_penalties(tiny_llama_dir, engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, frequency_penalty=1.5)
    logprobs = run(engine, params)
    tokens = [lp.token for lp in logprobs]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    for i, lp in enumerate(logprobs):
        counts = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=logits.shape[1])
        expected = (logits[i] - 1.5 * counts[: logits.shape[1]]).log_softmax(-1)
        assert lp.logprob == pytest.approx(expected[lp.token].item(), abs=1e-4)


def test_tokens_a_mask_rules_out_get_the_floor_and_the_rest_share_all_the_mass():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    masked = torch.full_like(logits, float("-inf"))
    masked[0, [3, 9, 21]] = logits[0, [3, 9, 21]]
    (lp,) = logprobs_of(masked, [SamplingParams(temperature=0, logprobs=5)], [9])
    assert sorted(t for t, _ in lp.top[:3]) == [3, 9, 21]
    assert math.fsum(math.exp(v) for _, v in lp.top[:3]) == pytest.approx(1.0, abs=1e-6)
    assert [v for _, v in lp.top[3:]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]


def test_logprobs_out_of_range_are_refused():
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(InvalidRequest, match="logprobs"):
            SamplingParams(logprobs=bad).validate()

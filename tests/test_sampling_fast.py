"""The sampler's fast path: no sort unless top-k/top-p ask, noise per shared generator in one call."""

from __future__ import annotations

import torch

from gpu_workers import SamplingParams
from gpu_workers.engine.sampling import _filtered_probs, _probs, first_argmax, sample


def logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_unfiltered_rows_are_the_tempered_softmax_and_filtered_rows_match_the_sorting_path():
    x = logits(3)
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(top_p=0.5),
    ]
    probs = _probs(x, params)
    assert torch.allclose(probs[0], (x[0] / 0.7).softmax(-1))
    assert torch.allclose(probs[1:], _filtered_probs(x[1:] / torch.tensor([[1.3], [1.0]]), params[1:]))
    assert (probs[1] > 0).sum() == 5


def test_rows_sharing_a_generator_draw_what_one_draw_per_row_would():
    x = logits(4)
    params = [SamplingParams(temperature=1.0)] * 4
    batched = sample(x, params, [torch.Generator().manual_seed(7)] * 4).tolist()
    g = torch.Generator().manual_seed(7)
    one_by_one = []
    for row in x.softmax(-1):
        noise = torch.empty_like(row).exponential_(generator=g)
        one_by_one.append(int((row / noise).argmax()))
    assert batched == one_by_one


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    x = logits(3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
    ]
    tokens = sample(x, params, [torch.Generator().manual_seed(i) for i in range(3)]).tolist()
    assert tokens[0] == int(x[0].argmax()) and tokens[2] == int(x[2].argmax())
    assert 0 <= tokens[1] < x.shape[1]


def test_a_seeded_row_draws_the_same_token_alone_or_in_a_batch():
    x = logits(5)
    params = [SamplingParams(temperature=1.0, seed=3)] + [SamplingParams(temperature=1.0)] * 4
    alone = sample(x[:1], params[:1], [torch.Generator().manual_seed(11)]).tolist()
    shared = torch.Generator().manual_seed(0)
    batched = sample(x, params, [torch.Generator().manual_seed(11)] + [shared] * 4).tolist()
    assert batched[0] == alone[0]


def test_first_argmax_gives_torchs_indices_with_ties_infinities_and_nans():
    x = logits(6, vocab=300)
    x[1, 10] = x[1, 200] = x[1].max() + 1  # a tie: the first one wins
    x[2, :] = 0.0  # all equal: index 0
    x[3, 7] = float("inf")
    x[4, 50] = float("nan")  # a NaN is the maximum, as in torch's max
    x[4, 90] = float("nan")
    x[5, :] = float("-inf")
    expected = x.max(dim=-1).indices.tolist()
    assert expected[:5] == [int(x[0].argmax()), 10, 0, 7, 50]
    assert first_argmax(x).tolist() == expected
    assert first_argmax(x[:, ::2]).tolist() == x[:, ::2].max(dim=-1).indices.tolist()  # a strided view

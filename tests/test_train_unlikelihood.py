"""The trainer's --unlikelihood: the token-level unlikelihood term is what its definition says (checked
against a direct sum over each position's candidate set), it pushes down the probability of repeating a token
the context holds while the target's rises, and a run with it writes a checkpoint at every evaluation
(``--checkpoint last``) with the step it started at on record."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_workers.tools.train import pycode
from gpu_workers.tools.train.model import (
    CausalAttention,
    build_model,
    greedy_continuations,
    hf_config,
    repeated_ngram_mask,
    sequence_unlikelihood_loss,
    unlikelihood_loss,
)
from tests.test_train_device import TINY_MODEL, small_stdlib  # noqa: F401  (the fixture)


def direct_unlikelihood(log_probs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    probs = log_probs.exp()
    total = torch.zeros(())
    batch, seq_len = inputs.shape
    for b in range(batch):
        for t in range(seq_len):
            candidates = set(inputs[b, : t + 1].tolist()) - {targets[b, t].item()}
            for c in candidates:
                total = total - torch.log(1 - probs[b, t, c])
    return total / (batch * seq_len)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_loss_is_the_sum_over_each_positions_earlier_tokens_but_the_target(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, seq_len, vocab = 3, 9, 7  # a small vocabulary: tokens repeat, and targets are often in context
    log_probs = torch.randn(batch, seq_len, vocab, generator=gen).log_softmax(-1)
    inputs = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    targets = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    got = unlikelihood_loss(log_probs, inputs, targets)
    assert got.item() == pytest.approx(direct_unlikelihood(log_probs, inputs, targets).item(), rel=1e-5)
    assert got.item() > 0


def test_a_step_on_it_lowers_a_repeat_and_leaves_new_tokens_alone():
    vocab = 5
    inputs = torch.tensor([[3, 4, 3]])
    targets = torch.tensor([[4, 3, 1]])  # at the last position, 3 and 4 are in context and 1 is the target
    logits = torch.zeros(1, 3, vocab, requires_grad=True)
    unlikelihood_loss(logits.log_softmax(-1), inputs, targets).backward()
    last = logits.grad[0, 2]
    assert last[3] > 0 and last[4] > 0  # descending the gradient lowers both repeats
    assert last[1] < 0 and last[0] < 0 and last[2] < 0  # and raises everything not yet seen
    assert torch.all(logits.grad[0, 0, [0, 1, 2, 4]] < 0) and logits.grad[0, 0, 3] > 0


def test_a_run_with_it_checkpoints_every_evaluation_and_records_it(small_stdlib, tmp_path):  # noqa: F811
    out = tmp_path / "model"
    common = [*TINY_MODEL, "--warmup-steps", "1", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    pycode.main([*common, "--steps", "4", "--eval-every", "1", "--max-minutes", "0"])  # stops after step 1
    before = (out / "model.safetensors").read_bytes()
    # Resumed with the term, at a learning rate high enough that held-out loss gets worse: "last" writes anyway.
    pycode.main(
        [*common, "--steps", "4", "--eval-every", "1", "--resume", "--lr", "3.0"]
        + ["--unlikelihood", "1.0", "--checkpoint", "last"]
    )
    record = json.loads((out / "training.json").read_text())
    assert record["unlikelihood_from_step"] == 1 and record["steps_done"] == 4
    assert record["hyperparameters"]["unlikelihood"] == 1.0
    assert record["best_step"] == 1 and record["heldout_curve"][-1][0] == 4  # worse, and still written
    assert (out / "model.safetensors").read_bytes() != before


def test_repeated_ngrams_are_flagged_from_their_second_occurrence_on():
    tokens = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    mask = repeated_ngram_mask(tokens, 4)
    assert mask[0].tolist() == [False] * 4 + [True] * 4 + [False]  # the second 1 2 3 4
    assert not mask[1].any()
    assert repeated_ngram_mask(torch.tensor([[7, 7, 7, 7, 7]]), 4)[0].tolist() == [
        False,
        True,
        True,
        True,
        True,
    ]


def test_a_sequence_step_makes_the_models_own_greedy_loop_less_likely():
    config = hf_config(50, 32, 64, 1, 2, 1, 64, 10000.0)
    model = build_model(config, seed=0)
    prefixes = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    # A freshly initialised model's greedy continuations loop: most of their tokens are repeats.
    rows = greedy_continuations(model, prefixes, 24)
    assert rows.shape == (2, 28) and torch.equal(rows[:, :4], prefixes)
    flagged = repeated_ngram_mask(rows[:, 4:], 4)

    def repeat_logprob() -> float:
        with torch.no_grad():
            batch, seq_len = rows.shape
            hidden = model(
                rows[:, :-1].reshape(-1),
                torch.arange(seq_len - 1).repeat(batch),
                CausalAttention(batch, seq_len - 1),
            )
            lp = torch.log_softmax(model.compute_logits(hidden), -1).view(batch, seq_len - 1, -1)[:, 3:]
            return lp.gather(2, rows[:, 4:].unsqueeze(-1)).squeeze(-1)[flagged].mean().item()

    before = repeat_logprob()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss, share = sequence_unlikelihood_loss(model, prefixes, 24)
    assert share == pytest.approx(flagged.float().mean().item()) and share > 0.5
    loss.backward()
    optimizer.step()
    assert repeat_logprob() < before - 0.05


def test_a_run_in_phases_pauses_with_its_state_and_resumes_where_it_stopped(small_stdlib, tmp_path):  # noqa: F811
    out, work = tmp_path / "model", tmp_path / "work"
    common = [*TINY_MODEL, "--warmup-steps", "1", "--out", str(out), "--work-dir", str(work), "--steps", "4"]
    pycode.main([*common, "--eval-every", "2", "--pause-at-step", "2"])
    assert json.loads((out / "training.json").read_text())["status"] == "in progress (step 2)"
    pycode.main([*common, "--eval-every", "2", "--resume", "--unlikelihood", "0.5"])
    record = json.loads((out / "training.json").read_text())
    assert record["status"] == "complete" and record["steps_done"] == 4
    assert record["unlikelihood_from_step"] == 2
    assert [step for step, _ in record["heldout_curve"]] == [2, 4]

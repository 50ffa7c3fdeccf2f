"""Repetition guards: frequency/presence penalties (OpenAI) and repetition_penalty (HF/vLLM), in the
sampler, per request, from the worker's Sampling message to the engine and the offline CLI."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli import tessera
from transformers import RepetitionPenaltyLogitsProcessor

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.engine import InvalidRequest
from gpu_workers.engine.sampling import apply_penalties, sample
from gpu_workers.pools.tasks import sampling_params
from gpu_workers.protocol import Sampling

PROMPTS = [[5, 9, 33], [17, 2, 64, 90], [40]]


def make_engine(path) -> Engine:
    config = EngineConfig(dtype="float32", kv_budget_bytes=4 * 2**20, page_size=4, max_num_batched_tokens=64)
    return Engine.from_pretrained(path, config)


def random_logits(rows: int, vocab: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def has_repeat(ids: list[int]) -> bool:
    return len(set(ids)) < len(ids)


# -- the logits processing ---------------------------------------------------------------------------------


def test_frequency_and_presence_penalties_equal_a_hand_computed_reference():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.25)]
    # Token 1 generated twice, token 4 once; the prompt's tokens (0, 3) do not count for OpenAI's penalties.
    out = apply_penalties(logits, params, [([0, 3, 3], [1, 4, 1])])
    expected = torch.tensor([[1.0, 2.0 - 0.5 * 2 - 1.25, -1.0, 0.5, 3.0 - 0.5 - 1.25]])
    assert torch.equal(out, expected)
    assert torch.equal(logits, torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]]))  # the input is left as it was


def test_negative_penalties_encourage_repeats():
    logits = torch.zeros(1, 4)
    out = apply_penalties(
        logits, [SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0)], [([], [2])]
    )
    assert out.tolist() == [[0.0, 0.0, 3.0, 0.0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 4.0]])
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [([0, 1], [1, 4])])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 2.0]]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    logits = random_logits(3, vocab=50)
    histories = [([3, 7, 7], [9, 3]), ([], [1, 1, 2]), ([49, 0], [])]
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    ours = apply_penalties(logits, params, histories)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for row, (prompt, output) in enumerate(histories):
        reference = processor(torch.tensor([prompt + output]), logits[row : row + 1].clone())
        assert torch.allclose(ours[row : row + 1], reference), row


def test_vllm_order_repetition_first_then_frequency_and_presence():
    logits = torch.tensor([[4.0, -4.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)]
    out = apply_penalties(logits, params, [([2], [0, 0, 1])])
    assert out.tolist() == [[4.0 / 2 - 2 - 0.5, -4.0 * 2 - 1 - 0.5, 1.0 / 2]]


def test_only_rows_asking_for_a_penalty_change_and_each_equals_itself_alone():
    logits = random_logits(4)
    histories = [([1, 2], [3, 3, 4]), ([5], [6, 6]), ([7], [8]), ([2], [2, 9])]
    params = [
        SamplingParams(frequency_penalty=1.5),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.3),
        SamplingParams(temperature=0.0),
    ]
    batched = apply_penalties(logits, params, histories)
    assert torch.equal(batched[1], logits[1]) and torch.equal(batched[3], logits[3])
    for row in (0, 2):
        alone = apply_penalties(logits[row : row + 1], params[row : row + 1], histories[row : row + 1])
        assert torch.equal(batched[row : row + 1], alone)
        assert not torch.equal(batched[row], logits[row])


def test_no_penalty_anywhere_returns_the_logits_untouched():
    logits = random_logits(2)
    assert (
        apply_penalties(logits, [SamplingParams(), SamplingParams(temperature=0)], [([1], [1])] * 2) is logits
    )


def test_greedy_sampling_picks_the_penalised_argmax():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    history = [([], [0])]
    assert sample(logits, [SamplingParams(temperature=0)], [torch.Generator()], history).tolist() == [0]
    penalised = [SamplingParams(temperature=0, frequency_penalty=2.0)]
    assert sample(logits, penalised, [torch.Generator()], history).tolist() == [1]


# -- validation and plumbing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
    ],
)
def test_out_of_range_penalties_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.code == f"invalid_{field}" and field in info.value.message


def test_the_worker_maps_sampling_penalties_and_old_messages_default_to_off():
    message = Sampling(max_tokens=4, frequency_penalty=1.0, presence_penalty=-0.5, repetition_penalty=1.2)
    params = sampling_params(Sampling.from_json(message.to_json()))
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == (1.0, -0.5, 1.2)
    old = json.loads(message.to_json())
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        del old[name]
    params = sampling_params(Sampling.from_json(json.dumps(old)))
    assert not params.has_penalties


# -- the engine --------------------------------------------------------------------------------------------------


def test_a_strong_frequency_penalty_stops_greedy_loops(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    guarded = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
    )
    loops = [out.token_ids for out in engine.generate(PROMPTS, plain)]
    assert all(has_repeat(ids) for ids in loops)  # the random model loops without a guard
    for ids in (out.token_ids for out in engine.generate(PROMPTS, guarded)):
        assert len(ids) == 40 and not has_repeat(ids), ids


def test_repetition_penalty_changes_greedy_output_and_counts_the_prompt(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    plain = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    guarded = engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=3.0)
    )
    assert [o.token_ids for o in plain] != [o.token_ids for o in guarded]
    repeats = sum(len(o.token_ids) - len(set(o.token_ids)) for o in plain)
    assert sum(len(o.token_ids) - len(set(o.token_ids)) for o in guarded) < repeats


def test_same_seed_same_penalised_output(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(
        temperature=0.9,
        max_tokens=20,
        ignore_eos=True,
        seed=11,
        frequency_penalty=1.0,
        repetition_penalty=1.2,
    )
    first = [o.token_ids for o in engine.generate(PROMPTS, params)]
    second = [o.token_ids for o in make_engine(tiny_llama_dir).generate(PROMPTS, params)]
    assert first == second
    other = SamplingParams(**{**params.__dict__, "seed": 12})
    assert [o.token_ids for o in engine.generate(PROMPTS, other)] != first


def test_rows_with_and_without_penalties_in_one_batch_equal_each_run_alone(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompts = PROMPTS + [[3, 3, 3, 8], [60, 61]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=5, presence_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0),
        SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=6),
    ]
    batched = [o.token_ids for o in engine.generate(prompts, params)]
    alone = [
        make_engine(tiny_llama_dir).generate([p], q)[0].token_ids
        for p, q in zip(prompts, params, strict=True)
    ]
    assert batched == alone


def run_to_end(engine: Engine, prompt: list[int], params: SamplingParams, **kwargs) -> list[int]:
    events = []
    engine.add_request(prompt, params, on_event=events.append, **kwargs)
    while engine.has_unfinished():
        engine.step()
    return [t for e in events for t in e.token_ids]


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}])
def test_a_handed_off_first_token_counts_as_output_for_the_penalties(tiny_llama_dir, penalty):
    """Disaggregated serving: prefill samples the first token, decode continues from prompt + [first] with
    streamed_output=1. The penalties must count that token as output, as one engine does."""
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalty)
    for prompt in PROMPTS:
        whole = run_to_end(engine, prompt, params)
        first = run_to_end(engine, prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}))
        rest = run_to_end(
            engine, prompt + first, SamplingParams(**{**params.__dict__, "max_tokens": 23}), streamed_output=1
        )
        assert first + rest == whole


def test_the_engine_refuses_out_of_range_penalties(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    [out] = engine.generate([[5, 6]], SamplingParams(max_tokens=4, presence_penalty=3.0))
    assert out.finish_reason == "error" and out.error.code == "invalid_presence_penalty"


# -- the offline CLI ------------------------------------------------------------------------------------------


def test_generate_flags_apply_the_penalties(demo_model_dir):
    args = ("generate", "--model", demo_model_dir, "--prompt-ids", "5,6,7", "--max-tokens", "24",
            "--temperature", "0", "--json", "--dtype", "float32")  # fmt: skip
    plain = tessera(*args)
    guarded = tessera(
        *args, "--frequency-penalty", "2", "--presence-penalty", "2", "--repetition-penalty", "1.5"
    )
    assert plain.returncode == 0 and guarded.returncode == 0, guarded.stderr
    assert json.loads(guarded.stdout)["token_ids"] != json.loads(plain.stdout)["token_ids"]
    refused = tessera(*args, "--frequency-penalty", "3")
    assert refused.returncode == 2 and "frequency_penalty" in refused.stderr

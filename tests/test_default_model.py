"""The shipped default model (models/pycode-tiny) loads through the Engine and has learned Python.

Its held-out perplexity must stay far below the unigram baseline recorded at training time, and its
greedy completions must look like Python. Everything runs in float32 through the serving code paths.
"""

from __future__ import annotations

import ast
import json
import math
import re
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tessera import installed_smollm2
from tessera.launcher import CHAT_MODEL, TRY_QUESTION

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.kv import AttentionMetadata
from gpu_workers.model.attention import PagedAttention

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "pycode-tiny"
CONTEXT = 2048
HELDOUT_FILE = "locale.py"  # in training.json's held-out list: never seen in training
SNIPPET_TOKENS = 512
# locale.py's first 512 tokens measure 28.1 (v2: 37.5; v1, the 512-token model: 80.8; whole held-out set
# now 9.7 at 2,048 tokens). The bound gives 1.5x headroom (another CPython's copy of the file, float
# rounding) and sits far below the unigram baseline (784 on the held-out set) and below v2's own 37.5.
PERPLEXITY_BOUND = 42.0


@pytest.fixture(scope="module")
def training_record() -> dict:
    return json.loads((MODEL_DIR / "training.json").read_text())


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(MODEL_DIR, EngineConfig(dtype="float32", kv_budget_bytes=16 * 2**20))


def paged_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits for every position of ``ids``, computed in one prefill through the engine's own paged cache."""
    page_size = engine.cache.page_size
    pages = list(range(math.ceil(len(ids) / page_size)))  # a fresh engine: every page is free
    meta = AttentionMetadata.build([pages], [len(ids)], [len(ids)], page_size)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids), torch.arange(len(ids)), PagedAttention(engine.cache, meta))
        return engine.model.compute_logits(hidden)


def test_checkpoint_is_small_and_loads_through_the_hf_loader(engine):
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 25 * 2**20
    assert engine.model.config.architecture == "LlamaForCausalLM"
    assert engine.tokenizer.eos_token_ids == [1]


def test_heldout_snippet_perplexity_is_far_below_unigram(engine, training_record):
    assert HELDOUT_FILE in training_record["corpus"]["heldout_files"]
    text = (Path(sysconfig.get_paths()["stdlib"]) / HELDOUT_FILE).read_text(encoding="utf-8")
    ids = engine.tokenizer.encode(text)[:SNIPPET_TOKENS]
    logits = paged_logits(engine, ids)
    perplexity = math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    assert perplexity < PERPLEXITY_BOUND < training_record["unigram_perplexity"] / 5


def test_engine_logits_match_transformers(engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    ids = engine.tokenizer.encode(
        "import os\n\n\ndef main(argv):\n    for name in argv:\n        print(name)\n"
    )
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    assert (paged_logits(engine, ids) - expected).abs().max().item() < 1e-4


def test_the_whole_context_is_served_and_matches_transformers_at_its_last_positions(engine):
    """2,048 tokens of a held-out file in one paged prefill: positions the first model never had."""
    from transformers import AutoModelForCausalLM

    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["max_position_embeddings"] == CONTEXT
    assert json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["model_max_length"] == CONTEXT
    text = (Path(sysconfig.get_paths()["stdlib"]) / HELDOUT_FILE).read_text(encoding="utf-8")
    ids = engine.tokenizer.encode(text)[:CONTEXT]
    assert len(ids) == CONTEXT
    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    ours = paged_logits(engine, ids)
    assert (ours - expected).abs().max().item() < 1e-4
    # Long context is used: the file's second half is predicted better than its first 512 tokens.
    losses = F.cross_entropy(ours[:-1], torch.tensor(ids[1:]), reduction="none")
    assert losses[1024:].mean() < losses[:512].mean()


def readme_chat_example() -> tuple[str, list[dict], SamplingParams]:
    """The model, messages and sampling of README.md's OpenAI SDK chat example, as written there."""
    readme = (ROOT / "README.md").read_text()
    call = re.search(r"client\.chat\.completions\.create\((.*?)\n\)", readme, re.S).group(1)
    model = re.search(r'model="([^"]+)"', call).group(1)
    messages = ast.literal_eval(re.search(r"messages=(\[.*?\]),\n", call, re.S).group(1))
    numbers = dict(re.findall(r"(max_tokens|temperature|frequency_penalty|presence_penalty)=([0-9.]+)", call))
    params = {k: float(v) for k, v in numbers.items()} | {"max_tokens": int(numbers["max_tokens"])}
    return model, messages, SamplingParams(**params)


def test_the_readmes_chat_example_answers_its_question():
    # The README's SDK example asks the default chat model, greedily, what its banner asks; the prefill
    # pool's engine (weights dequantised, which picks the first token) answers it as the README says.
    model, messages, params = readme_chat_example()
    assert model == CHAT_MODEL and params.temperature == 0  # greedy: what the README shows, every reader gets
    assert messages[-1]["content"] == TRY_QUESTION
    engine = Engine.from_pretrained(installed_smollm2(), EngineConfig(weights="bf16"))
    [out] = engine.generate([engine.tokenizer.encode_chat(messages)], params)
    assert "Paris" in out.text, out.text


def test_greedy_completion_of_a_method_def_is_a_valid_method_header(engine):
    # "def", not "def ": BPE folds the space into the name token, so a trailing space is off-distribution.
    # (A bare "def" at the top of a file loops on one identifier piece under greedy decoding: TRAINING.md.)
    head = "class Stack:\n    def"
    [out] = engine.generate([head], SamplingParams(temperature=0.0, max_tokens=24))
    header = head + out.text.split("\n")[0]
    ast.parse(header + "\n        pass\n")


def test_chat_template_continues_the_users_code_after_a_system_comment(engine):
    messages = [
        {"role": "system", "content": "You write Python.\nKeep it short."},
        {"role": "user", "content": "def fib(n):\n"},
    ]
    prompt = engine.tokenizer.apply_chat_template(messages)
    assert prompt == "<|bos|># You write Python.\n# Keep it short.\ndef fib(n):\n"
    # The assistant's turn continues the code: the user's code and the reply read as one file.
    turns = [*messages, {"role": "assistant", "content": "    return n"}, {"role": "user", "content": "\n"}]
    assert engine.tokenizer.apply_chat_template(turns).endswith("def fib(n):\n    return n\n")


def test_chat_reply_to_a_function_head_is_its_body(engine):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "def fib(n):"}])
    [out] = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=24))
    assert out.text.startswith("\n    ")  # the function's indented body, not prose or a comment

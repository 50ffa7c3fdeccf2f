"""The English text of ``tessera eval quality`` (``--text english``, for chat models): chunks of the standard
library's English prose, ``pydoc_data/topics.py`` (the text ``help()`` shows), scored for perplexity, KL and
top-1 agreement, and greedy answers to 20 fixed chat prompts rendered with the model's own chat template.

The topics are the reference manual's prose with some code examples; a model trained on web text may have
seen them (Python's docs are public), which lowers its perplexity but hardly the paired differences between
memory formats that this eval is for. The text follows the running Python's version, so results say which.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

import numpy as np
import torch

from gpu_workers.engine import Engine, SamplingParams
from gpu_workers.tokenizer import Tokenizer
from gpu_workers.tools.eval.bootstrap import estimate, file_resamples, ratio, token_statistics
from gpu_workers.tools.eval.scoring import score_logprobs
from gpu_workers.tools.metrics import next_token_metrics

# Fixed, so every run and every variant answers the same questions: facts, arithmetic, small coding tasks,
# lists, translations, a summary and a poem; short answers mostly, so 48 tokens hold a whole one.
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Who wrote the play Romeo and Juliet?",
    "What is the boiling point of water at sea level, in degrees Celsius?",
    "What is 17 + 25?",
    "What is 12 times 8?",
    "I have 3 apples and buy 5 more. How many apples do I have now?",
    "Write a Python function that returns the reverse of a string.",
    "Write a Python function that checks whether a number is prime.",
    "List three primary colors.",
    "List the first four planets of the solar system, in order from the Sun.",
    'Translate "Good morning, how are you?" into French.',
    'Translate "Thank you very much" into Spanish.',
    "Explain in one sentence what photosynthesis is.",
    "What is the largest ocean on Earth?",
    "How many days are there in a leap year?",
    'Give me a synonym for "happy".',
    "What does HTML stand for?",
    'Summarize in one sentence: "The cat sat on the mat all afternoon, watching the birds outside the window."',
    "Write a haiku about autumn.",
    "What is the chemical symbol for gold?",
)


def text_source() -> str:
    return f"pydoc_data/topics.py of Python {platform.python_version()}"


def topic_chunks(tokenizer: Tokenizer, count: int, tokens: int) -> dict[str, list[int]]:
    """Up to ``count`` chunks of ``tokens`` + 1 token ids (inputs and their next tokens), by topic name: the
    start of topics at least that long, spread evenly over their sorted names, one chunk per topic so the
    bootstrap's units are distinct texts."""
    from pydoc_data.topics import topics

    encoded = {name: tokenizer.encode(topics[name]) for name in sorted(topics)}
    long_enough = [name for name, ids in encoded.items() if len(ids) > tokens]
    if not long_enough:
        raise ValueError(f"no pydoc topic has more than {tokens} tokens; ask for shorter chunks")
    if len(long_enough) > count:
        long_enough = [long_enough[i * len(long_enough) // count] for i in range(count)]
    return {name: encoded[name][: tokens + 1] for name in long_enough}


def chat_prompt_ids(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` fixed prompts, each one user turn in the model's chat template."""
    if not 0 < count <= len(CHAT_PROMPTS):
        raise ValueError(
            f"there are {len(CHAT_PROMPTS)} fixed chat prompts; ask for 1 to {len(CHAT_PROMPTS)}"
        )
    return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:count]]


def measure_chunks(
    engines: dict[str, Engine],
    chunks: dict[str, list[int]],
    chunk_size: int,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Per variant, per chunk: (NLL, KL(baseline || variant), top-1 agreement) at every position."""
    base = engines["baseline"]
    stats: dict[str, list] = {name: [] for name in engines}
    for n, (name, ids) in enumerate(chunks.items()):
        log(f"[{n + 1}/{len(chunks)}] {name}")
        inputs, targets = ids[:-1], torch.tensor(ids[1:])
        base_lp = score_logprobs(base, inputs, chunk_size)
        for v, engine in engines.items():
            lp = base_lp if v == "baseline" else score_logprobs(engine, inputs, chunk_size)
            m = next_token_metrics(base_lp, lp, targets)
            stats[v].append((m.nll.numpy(), m.kl.numpy(), m.top1.numpy()))
    return stats


def greedy_answers(
    engines: dict[str, Engine], prompts: list[list[int]], max_tokens: int
) -> dict[str, list[list[int]]]:
    """Every variant's greedy answer to every prompt, ending at the model's end of turn or ``max_tokens``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return {v: [out.token_ids for out in engine.generate(prompts, params)] for v, engine in engines.items()}


def summarize_english(
    stats: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]],
    answers: dict[str, list[list[int]]],
    seed: int = 0,
) -> dict[str, dict]:
    """Point estimates and paired bootstrap 95% intervals: token metrics over chunks, exact match over prompts."""
    chunk_resamples = file_resamples(len(stats["baseline"]), seed)
    base_answers = answers["baseline"]
    prompt_resamples = file_resamples(len(base_answers), seed)
    base_nll = [nll for nll, _, _ in stats["baseline"]]
    out = {}
    for v, chunks in stats.items():
        result: dict = {}
        nll, kl, top1 = (list(arrays) for arrays in zip(*chunks, strict=True))
        for name, stat in token_statistics(nll, kl, top1, base_nll).items():
            result[name], result[f"{name}_ci95"] = estimate(stat, chunk_resamples)
        same = np.array([a == b for a, b in zip(answers[v], base_answers, strict=True)], dtype=float)
        result["chat_exact_match"], result["chat_exact_match_ci95"] = estimate(
            ratio(same, np.ones_like(same)), prompt_resamples
        )
        result.update(
            chat_answers_changed=int(len(same) - same.sum()),
            chat_prompts=len(same),
            chunks=len(chunks),
            tokens=sum(map(len, base_nll)),
            text=text_source(),
        )
        out[v] = result
    return out

"""``tessera eval quality``: a model in memory-format variants vs its baseline, on one of two texts.

``text="english"`` (chat models; english.py): chunks of the stdlib's English prose and greedy answers to 20
fixed chat prompts. ``text="python"`` (the code models trained here), the rest of this module, on the held-out
stdlib files: per variant, perplexity, per-token KL(baseline || variant) (mean and p99), top-1 agreement, greedy
continuations that match the baseline's exactly for 32/128 tokens, and the share of sampled function
completions that parse as Python. Every number carries a bootstrap 95% interval over files (files are
resampled, so a few unusual files cannot make a difference look certain); the sampled metric also pools
several seeds. Variants are compared paired: same files, same prompts, same sampling seeds.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import tokenizers
import torch

from gpu_workers.engine import Engine, EngineConfig, SamplingParams
from gpu_workers.tokenizer import Tokenizer, load_tokenizer
from gpu_workers.tools.eval import english
from gpu_workers.tools.eval.bootstrap import estimate, file_resamples, ratio, token_statistics
from gpu_workers.tools.eval.heldout import heldout_texts
from gpu_workers.tools.eval.scoring import score_logprobs
from gpu_workers.tools.metrics import next_token_metrics
from gpu_workers.tools.train.data import eval_windows, token_stream

BASELINES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
VARIANT_KEYS = {"kv": "kv_cache_dtype", "weights": "weights", "dtype": "dtype"}
TEXTS = ("english", "python")
# English (chat models, GGUFs among them): the baseline computes in fp32 on unquantised weights (a Q4 GGUF's
# dequantised), and each variant runs as served, in bf16, so its row holds the format's cost on top of bf16's;
# the dtype=bfloat16 row alone is that floor. weights=int4 keeps a GGUF's Q4_0/Q4_1 blocks as stored.
DEFAULT_BASELINE = {"english": "fp32", "python": "bf16"}
DEFAULT_VARIANTS = {
    "english": (
        "dtype=bfloat16",
        "dtype=bfloat16+kv=fp8_e4m3",
        "dtype=bfloat16+weights=int4",
        "dtype=bfloat16+kv=fp8_e4m3+weights=int4",
    ),
    "python": ("kv=fp8_e4m3", "weights=int4", "weights=fp8"),
}


@dataclass
class EvalSettings:
    text: str = "python"  # one of TEXTS
    # english
    chunks: int = 12
    chunk_tokens: int = 512
    chat_prompts: int = len(english.CHAT_PROMPTS)
    chat_tokens: int = 48
    # python
    max_files: int | None = None
    max_tokens_per_file: int | None = None
    seeds: int = 3
    chunk_size: int = 64  # scoring prefill chunk: most attention reads go through the (FP8) cache
    prompts_per_file: int = 2  # greedy-continuation cut points per file
    prompt_tokens: int = 256
    functions_per_file: int = 4  # sampled-completion prompts per file
    completion_tokens: int = 128
    temperature: float = 0.8
    bootstrap_seed: int = 0


@dataclass
class FileStats:
    """One file's per-token arrays and per-prompt outcomes for one variant."""

    nll: np.ndarray
    kl: np.ndarray
    top1: np.ndarray
    greedy: list[list[int]] = field(default_factory=list)
    valid: list[list[bool]] = field(default_factory=list)  # [seed][function]


def parse_variant(spec: str) -> dict[str, str]:
    """``kv=fp8_e4m3+weights=int4`` -> EngineConfig overrides {kv_cache_dtype: ..., weights: ...}."""
    overrides = {}
    for part in spec.split("+"):
        key, sep, value = part.partition("=")
        if not sep or key not in VARIANT_KEYS or not value:
            raise ValueError(
                f"bad variant {spec!r}: expected KEY=VALUE[+KEY=VALUE], KEY one of {sorted(VARIANT_KEYS)}, "
                "e.g. kv=fp8_e4m3 or kv=fp8_e4m3+weights=int4"
            )
        overrides[VARIANT_KEYS[key]] = value
    return overrides


def baseline_config(name: str) -> EngineConfig:
    """The baseline: ``name`` as the compute dtype, unquantised weights, KV cache in that dtype."""
    if name not in BASELINES:
        raise ValueError(f"baseline must be one of {sorted(BASELINES)}, got {name!r}")
    # No prefix cache: every measurement is independent of what ran before it.
    return EngineConfig(dtype=BASELINES[name], weights="bf16", kv_cache_dtype="auto", prefix_cache=False)


def greedy_prompts(
    tokenizer: tokenizers.Tokenizer, text: str, count: int, prompt_tokens: int
) -> list[list[int]]:
    """``count`` prompts cut at line boundaries spread over the file, each its last ``prompt_tokens``."""
    lines = text.splitlines(keepends=True)
    prompts = []
    for i in range(count):
        cut = (i + 1) * len(lines) // (count + 1)
        if cut == 0:
            continue
        ids = tokenizer.encode("".join(lines[:cut])).ids
        prompts.append(ids[-prompt_tokens:])
    return prompts


def function_prompts(text: str, count: int) -> list[str]:
    """Heads of up to ``count`` functions spread over the file: the ``def`` line(s) plus the docstring.

    Functions whose head is the whole function are skipped (nothing is left to complete). Methods and
    nested functions are dedented to column 0, so a completed function parses on its own.
    """
    lines = text.splitlines(keepends=True)
    heads = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        has_doc = has_doc and isinstance(first.value.value, str)
        head_end = first.end_lineno if has_doc else first.lineno - 1
        if head_end >= node.end_lineno or (has_doc and len(node.body) < 2):
            continue
        indent = node.col_offset
        head = [
            line[indent:] if line.strip() else line.lstrip(" ") for line in lines[node.lineno - 1 : head_end]
        ]
        # No trailing newline: the model writes the newline and indentation itself, as one token, the way
        # the tokenizer split them in training (a bare "\n" token followed by indentation is rare).
        heads.append("".join(head).rstrip())
    if len(heads) <= count:
        return heads
    return [heads[i * len(heads) // count] for i in range(count)]


def completes_function(head: str, completion: str) -> bool:
    """Whether head + completion, cut before the first line after the head back at column 0, parses."""
    lines = (head + completion).splitlines(keepends=True)
    end = next(
        (
            i
            for i in range(head.count("\n") + 1, len(lines))
            if lines[i].strip() and not lines[i][0].isspace()
        ),
        len(lines),
    )
    try:
        ast.parse("".join(lines[:end]))
    except (SyntaxError, ValueError):
        return False
    return True


class QualityRun:
    """The per-file measurements of every variant; ``summary`` turns them into numbers with intervals."""

    def __init__(
        self,
        model_dir: Path,
        tokenizer: Tokenizer,
        settings: EvalSettings,
        log: Callable[[str], None] = lambda _: None,
    ):
        self.settings = settings
        self.log = log
        self.tokenizer = tokenizer.backend  # the raw text, no chat template or added BOS
        self.files = heldout_texts([Path(model_dir)], settings.max_files)

    def measure(self, engines: dict[str, Engine]) -> dict[str, list[FileStats]]:
        """Run every file through every engine; engines["baseline"] is the reference."""
        s = self.settings
        base = engines["baseline"]
        stats: dict[str, list[FileStats]] = {name: [] for name in engines}
        seq_len = base.max_model_len
        for n, (name, text) in enumerate(self.files.items()):
            self.log(f"[{n + 1}/{len(self.files)}] {name}")
            stream = token_stream(self.tokenizer, [text])
            if s.max_tokens_per_file:
                stream = stream[: s.max_tokens_per_file + 1]
            per_variant: dict[str, list[tuple]] = {v: [] for v in engines}
            for inputs, targets in eval_windows(stream, seq_len):
                ids = inputs.tolist()
                base_lp = score_logprobs(base, ids, s.chunk_size)
                for v, engine in engines.items():
                    lp = base_lp if v == "baseline" else score_logprobs(engine, ids, s.chunk_size)
                    m = next_token_metrics(base_lp, lp, targets)
                    per_variant[v].append((m.nll, m.kl, m.top1))
            prompts = greedy_prompts(
                self.tokenizer, text, s.prompts_per_file, min(s.prompt_tokens, seq_len - 129)
            )
            heads = function_prompts(text, s.functions_per_file)
            for v, engine in engines.items():
                nll, kl, top1 = (torch.cat(parts).numpy() for parts in zip(*per_variant[v], strict=True))
                stats[v].append(
                    FileStats(nll, kl, top1, self._greedy(engine, prompts), self._valid(engine, heads))
                )
        return stats

    def _greedy(self, engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
        if not prompts:
            return []
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        return [out.token_ids for out in engine.generate(prompts, params)]

    def _valid(self, engine: Engine, heads: list[str]) -> list[list[bool]]:
        s = self.settings
        results = []
        for seed in range(s.seeds):
            # The same seed per (seed, prompt) in every variant: differences come from the format alone.
            params = [
                SamplingParams(
                    max_tokens=s.completion_tokens,
                    temperature=s.temperature,
                    seed=seed * 1000 + i,
                    stop=["\n\n"],
                )
                for i in range(len(heads))
            ]
            outs = engine.generate(list(heads), params) if heads else []
            results.append([completes_function(h, o.text) for h, o in zip(heads, outs, strict=True)])
        return results


def summarize(stats: dict[str, list[FileStats]], seed: int = 0) -> dict[str, dict]:
    """Point estimates and bootstrap 95% intervals (files resampled) for every variant."""
    base = stats["baseline"]
    num_files = len(base)
    resamples = file_resamples(num_files, seed)
    out = {}
    for v, files in stats.items():
        match32, match128, prompts = (np.zeros(num_files) for _ in range(3))
        for i, (f, b) in enumerate(zip(files, base, strict=True)):
            prompts[i] = len(b.greedy)
            match32[i] = sum(g[:32] == bg[:32] for g, bg in zip(f.greedy, b.greedy, strict=True))
            match128[i] = sum(g[:128] == bg[:128] for g, bg in zip(f.greedy, b.greedy, strict=True))
        valid = np.array([sum(map(sum, f.valid)) for f in files], dtype=float)
        completions = np.array([sum(map(len, f.valid)) for f in files], dtype=float)

        metrics = token_statistics(
            [f.nll for f in files], [f.kl for f in files], [f.top1 for f in files], [f.nll for f in base]
        ) | {
            "exact_match_32": ratio(match32, prompts),
            "exact_match_128": ratio(match128, prompts),
            "valid_python": ratio(valid, completions),
        }
        result: dict = {}
        for name, stat in metrics.items():
            result[name], result[f"{name}_ci95"] = estimate(stat, resamples)
        result["valid_python_per_seed"] = [
            sum(sum(f.valid[s]) for f in files) / max(sum(len(f.valid[s]) for f in files), 1)
            for s in range(len(files[0].valid))
        ]
        result.update(
            files=num_files,
            tokens=sum(len(f.nll) for f in base),
            greedy_prompts=int(prompts.sum()),
            completions=int(completions.sum()),
        )
        out[v] = result
    return out


def run_quality(
    model: Path,
    baseline: str,
    variants: list[str],
    settings: EvalSettings,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, dict]:
    """Measure every variant that loads; one that cannot load reports ``{"error": ...}`` and is skipped.

    ``model``: a checkpoint folder or a GGUF file."""
    if settings.text not in TEXTS:
        raise ValueError(f"text must be one of {TEXTS}, got {settings.text!r}")
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer.json; the evaluation encodes text with it")
    if settings.text == "english" and not tokenizer.has_chat_template:
        raise ValueError(
            f"{model} has no chat template, and the English text includes chat prompts; "
            "use text 'python' for a model that continues code"
        )
    base_config = baseline_config(baseline)
    configs = {"baseline": base_config}
    errors: dict[str, dict] = {}
    for spec in variants:
        try:
            configs[spec] = replace(base_config, **parse_variant(spec))
        except (ValueError, TypeError) as exc:
            errors[spec] = {"error": f"{type(exc).__name__}: {exc}"}
    engines = {}
    for name, config in configs.items():
        try:
            engines[name] = Engine.from_pretrained(model, config)
        except Exception as exc:  # noqa: BLE001 -- one variant failing to load must not stop the others
            if name == "baseline":
                raise
            errors[name] = {"error": f"could not load this variant: {type(exc).__name__}: {exc}"}
    if settings.text == "english":
        chunks = english.topic_chunks(tokenizer, settings.chunks, settings.chunk_tokens)
        stats = english.measure_chunks(engines, chunks, settings.chunk_size, log)
        log(f"greedy answers to {settings.chat_prompts} chat prompts")
        prompts = english.chat_prompt_ids(tokenizer, settings.chat_prompts)
        answers = english.greedy_answers(engines, prompts, settings.chat_tokens)
        summary = english.summarize_english(stats, answers, settings.bootstrap_seed)
        for name, result in summary.items():
            result["chat_answers"] = [tokenizer.decode(a) for a in answers[name]]
    else:
        run = QualityRun(model, tokenizer, settings, log)
        summary = summarize(run.measure(engines), settings.bootstrap_seed)
    for name, config in configs.items():
        if name in summary:
            summary[name]["config"] = {
                "dtype": config.dtype,
                "kv_cache_dtype": config.kv_cache_dtype,
                "weights": config.weights,
            }
    return {**summary, **errors}

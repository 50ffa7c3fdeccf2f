"""``tessera eval quality``: a model in memory-format variants vs its baseline, on the held-out stdlib files.

Per variant: perplexity, per-token KL(baseline || variant) (mean and p99), top-1 agreement, greedy
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
import torch
from tokenizers import Tokenizer

from gpu_workers.engine import Engine, EngineConfig, SamplingParams
from gpu_workers.tools.eval.bootstrap import estimate, file_resamples, pooled_quantile, ratio
from gpu_workers.tools.eval.heldout import heldout_texts
from gpu_workers.tools.eval.scoring import score_logprobs
from gpu_workers.tools.metrics import next_token_metrics
from gpu_workers.tools.train.data import eval_windows, token_stream

BASELINES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
VARIANT_KEYS = {"kv": "kv_cache_dtype", "weights": "weights", "dtype": "dtype"}


@dataclass
class EvalSettings:
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


def greedy_prompts(tokenizer: Tokenizer, text: str, count: int, prompt_tokens: int) -> list[list[int]]:
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

    def __init__(self, model_dir: Path, settings: EvalSettings, log: Callable[[str], None] = lambda _: None):
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.log = log
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.files = heldout_texts([self.model_dir], settings.max_files)

    def load(self, config: EngineConfig) -> Engine:
        return Engine.from_pretrained(self.model_dir, config)

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
    tokens = np.array([len(f.nll) for f in base], dtype=float)
    base_nll = np.array([f.nll.sum() for f in base])
    out = {}
    for v, files in stats.items():
        nll = np.array([f.nll.sum() for f in files])
        kl = np.array([f.kl.sum() for f in files])
        top1 = np.array([f.top1.sum() for f in files], dtype=float)
        match32, match128, prompts = (np.zeros(num_files) for _ in range(3))
        for i, (f, b) in enumerate(zip(files, base, strict=True)):
            prompts[i] = len(b.greedy)
            match32[i] = sum(g[:32] == bg[:32] for g, bg in zip(f.greedy, b.greedy, strict=True))
            match128[i] = sum(g[:128] == bg[:128] for g, bg in zip(f.greedy, b.greedy, strict=True))
        valid = np.array([sum(map(sum, f.valid)) for f in files], dtype=float)
        completions = np.array([sum(map(len, f.valid)) for f in files], dtype=float)

        metrics: dict[str, Callable[[np.ndarray], np.ndarray]] = {
            "perplexity": ratio(nll, tokens, np.exp),
            "perplexity_delta_pct": ratio(nll - base_nll, tokens, lambda x: 100 * np.expm1(x)),
            "kl_mean": ratio(kl, tokens),
            "kl_p99": pooled_quantile([f.kl for f in files], 0.99),
            "top1_agreement": ratio(top1, tokens),
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
            tokens=int(tokens.sum()),
            greedy_prompts=int(prompts.sum()),
            completions=int(completions.sum()),
        )
        out[v] = result
    return out


def run_quality(
    model_dir: Path,
    baseline: str,
    variants: list[str],
    settings: EvalSettings,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, dict]:
    """Measure every variant that loads; one that cannot load reports ``{"error": ...}`` and is skipped."""
    run = QualityRun(model_dir, settings, log)
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
            engines[name] = run.load(config)
        except Exception as exc:  # noqa: BLE001 -- one variant failing to load must not stop the others
            if name == "baseline":
                raise
            errors[name] = {"error": f"could not load this variant: {type(exc).__name__}: {exc}"}
    summary = summarize(run.measure(engines), settings.bootstrap_seed)
    for name, config in configs.items():
        if name in summary:
            summary[name]["config"] = {
                "dtype": config.dtype,
                "kv_cache_dtype": config.kv_cache_dtype,
                "weights": config.weights,
            }
    return {**summary, **errors}

"""``tessera eval lm``: held-out language-model loss of one or more checkpoints, side by side in one run.

Per model: nats per target token, perplexity and bits per byte (total nats / ln 2 / UTF-8 bytes of the text
the targets cover; every tokenizer's targets cover the same bytes, so the number compares across
tokenizers), each with a bootstrap 95% interval over files, and every later model's relative bits-per-byte
change against the first (paired: same files, same resamples).

Each file is its own document (``<|bos|> tokens <|eos|>``, ``train.data.token_stream``) cut into
non-overlapping windows of the model's context from its first token (``train.data.eval_windows``): every
token after ``<|bos|>`` is a target exactly once, and a longer context gives the average target more
history. Loss by position: over the files whose first window is full at the longest context in the run (the
same files for every model), the mean loss of targets at positions [0, 512), [512, 1024), [1024, 2048), ...
up to the model's context. Position p is the input token whose output predicts the target, so the target is
the file's token p + 1, predicted from p + 1 tokens (p = 0: from ``<|bos|>`` alone).

The models run as the serving code loads them (``gpu_workers.model.load_model``, float32) in batched
causal forward passes (the training script's attention backend, no KV cache).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from gpu_workers.model import load_model
from gpu_workers.tools.eval.bootstrap import Statistic, estimate, file_resamples, ratio
from gpu_workers.tools.train.data import PAD_ID, eval_windows, token_stream
from gpu_workers.tools.train.model import CausalAttention

FIRST_BUCKET = 512  # positions [0, 512); each later bucket doubles the end: [512, 1024), [1024, 2048), ...
BATCH_TOKENS = 8192  # rows x padded length of one forward pass


@dataclass
class ModelScore:
    """One model's per-target NLL (nats) for every file, in file order, and the context it ran at."""

    context: int
    max_position_embeddings: int
    nll: list[np.ndarray]


def position_buckets(context: int) -> list[tuple[int, int]]:
    """[0, 512), [512, 1024), [1024, 2048), ... up to ``context`` (the last one cut at it)."""
    edges, end = [0], FIRST_BUCKET
    while edges[-1] < context:
        edges.append(min(end, context))
        end *= 2
    return list(zip(edges[:-1], edges[1:], strict=True))


@torch.inference_mode()
def window_nll(
    model: torch.nn.Module,
    windows: Sequence[tuple[torch.Tensor, torch.Tensor]],
    batch_tokens: int = BATCH_TOKENS,
) -> list[np.ndarray]:
    """NLL (nats, float64) of every target of each (inputs, targets) window, in batched forward passes.

    Windows are sorted by length and right-padded to the longest in their batch: under causal attention a
    padding token comes after every real one, so it cannot change them.
    """
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
    out: list[np.ndarray] = [np.empty(0)] * len(windows)
    start = 0
    while start < len(order):
        seq_len = len(windows[order[start]][0])
        group = order[start : start + max(1, batch_tokens // seq_len)]
        start += len(group)
        inputs = torch.full((len(group), seq_len), PAD_ID, dtype=torch.long)
        targets = torch.full((len(group), seq_len), -100, dtype=torch.long)
        for row, w in enumerate(group):
            n = len(windows[w][0])
            inputs[row, :n], targets[row, :n] = windows[w]
        positions = torch.arange(seq_len).repeat(len(group))
        hidden = model(inputs.reshape(-1), positions, CausalAttention(len(group), seq_len))
        nll = F.cross_entropy(
            model.compute_logits(hidden).float(), targets.reshape(-1), ignore_index=-100, reduction="none"
        ).view(len(group), seq_len)
        for row, w in enumerate(group):
            out[w] = nll[row, : len(windows[w][0])].double().numpy()
    return out


def score_model(
    model_dir: Path,
    texts: dict[str, str],
    context: int | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> ModelScore:
    """Every target of every text under the model at ``model_dir``, at ``context`` (default: its own)."""
    model_dir = Path(model_dir)
    model = load_model(model_dir, dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    max_positions = model.config.max_position_embeddings
    context = context or max_positions
    windows, owners = [], []
    for i, (name, text) in enumerate(texts.items()):
        stream = token_stream(tokenizer, [text])
        # Bits per byte divides by the whole file's bytes: the targets (all tokens after <|bos|>) must
        # decode to exactly the file.
        if tokenizer.decode(stream[1:].tolist()) != text:
            raise ValueError(
                f"{model_dir}'s tokenizer does not encode {name} as <|bos|> + tokens that decode back to the "
                "file, so its targets would not cover the file's bytes and bits per byte would not compare"
            )
        for window in eval_windows(stream, context):
            windows.append(window)
            owners.append(i)
    per_window = window_nll(model, windows, batch_tokens)
    nll = [
        np.concatenate([w for w, o in zip(per_window, owners, strict=True) if o == i])
        for i in range(len(texts))
    ]
    return ModelScore(context, max_positions, nll)


def summarize_lm(scores: dict[str, ModelScore], texts: dict[str, str], seed: int = 0) -> dict:
    """Point estimates with bootstrap 95% intervals (files resampled) per model, and loss by position."""
    names = list(texts)
    num_bytes = np.array([len(t.encode("utf-8")) for t in texts.values()], dtype=float)
    resamples = file_resamples(len(names), seed)
    longest = max(s.context for s in scores.values())
    # Files whose first window is full at the longest context: their first `longest` targets exist.
    long_files = [i for i in range(len(names)) if all(len(s.nll[i]) >= longest for s in scores.values())]
    long_resamples = file_resamples(len(long_files), seed) if long_files else None
    first_nll = None
    models = {}
    for label, score in scores.items():
        nll = np.array([f.sum() for f in score.nll])
        targets = np.array([len(f) for f in score.nll], dtype=float)
        metrics: dict[str, Statistic] = {
            "nats_per_token": ratio(nll, targets),
            "perplexity": ratio(nll, targets, np.exp),
            "bits_per_byte": ratio(nll, num_bytes, lambda x: x / math.log(2)),
        }
        if first_nll is None:
            first_nll = nll
        else:  # the bytes are the same for every model, so the bpb ratio is the ratio of total nats
            metrics["bpb_change_pct"] = ratio(nll, first_nll, lambda x: 100 * (x - 1))
        result: dict = {
            "context": score.context,
            "max_position_embeddings": score.max_position_embeddings,
            "targets": int(targets.sum()),
        }
        for key, stat in metrics.items():
            result[key], result[f"{key}_ci95"] = estimate(stat, resamples)
        result["position_buckets"] = _buckets(score, long_files, long_resamples)
        models[label] = result
    return {
        "files": len(names),
        "bytes": int(num_bytes.sum()),
        "bucket_files": [names[i] for i in long_files],
        "bucket_context": longest,
        "models": models,
    }


def _buckets(score: ModelScore, files: list[int], resamples: np.ndarray | None) -> list[dict]:
    if resamples is None:
        return []
    buckets = []
    stats: list[Statistic] = []
    for lo, hi in position_buckets(score.context):
        sums = np.array([score.nll[i][lo:hi].sum() for i in files])
        counts = np.full(len(files), float(hi - lo))
        stats.append(ratio(sums, counts))
        loss, ci = estimate(stats[-1], resamples)
        buckets.append({"positions": [lo, hi], "loss": loss, "loss_ci95": ci, "targets": int(counts.sum())})
    if len(stats) > 1:
        first, last = stats[0], stats[-1]
        delta, ci = estimate(lambda idx: last(idx) - first(idx), resamples)
        buckets[-1]["minus_first"], buckets[-1]["minus_first_ci95"] = delta, ci
    return buckets


def run_lm(
    model_dirs: Sequence[Path],
    texts: dict[str, str],
    context: int | None = None,
    batch_tokens: int = BATCH_TOKENS,
    seed: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Score ``texts`` with every model (keyed by its path as given) and summarise; the first is the
    reference the others' bits-per-byte change is measured against."""
    if not texts:
        raise ValueError("no texts to score")
    scores = {}
    for model_dir in model_dirs:
        started = time.perf_counter()
        scores[str(model_dir)] = score = score_model(Path(model_dir), texts, context, batch_tokens)
        note = f"{model_dir}: {len(texts)} files at context {score.context}"
        if score.context > score.max_position_embeddings:
            note += f", beyond its max_position_embeddings {score.max_position_embeddings}"
        log(f"{note}, {time.perf_counter() - started:.1f}s")
    return summarize_lm(scores, texts, seed)

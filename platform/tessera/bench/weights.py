"""``tessera bench weights``: quality and size of fp8/int4 weights against the checkpoint's own.

Converts the model with ``tessera quantize`` into a temporary folder per format, then runs each converted
model and the original (float32 compute, so only weight error shows) over the same text: per-layer
relative error, logit KL, top-1 agreement and perplexity.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path


def run_weights(
    model_dir: Path,
    formats: list[str],
    group_size: int,
    symmetric: bool,
    text_files: list[Path] | None,
    max_tokens: int,
    per_layer: bool,
    as_json: bool,
) -> None:
    """``symmetric`` applies to int4 only; without ``text_files``, a few standard-library modules."""
    import torch

    from gpu_workers.model import load_model
    from gpu_workers.tokenizer import load_tokenizer
    from gpu_workers.tools.calibrate import default_sample_texts
    from gpu_workers.tools.metrics import compare_models, token_windows
    from gpu_workers.tools.quantize import quantize_checkpoint

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer.json, so evaluation text cannot be tokenized")
    texts = [p.read_text(encoding="utf-8") for p in text_files] if text_files else default_sample_texts()
    windows = token_windows([tokenizer.encode(t) for t in texts], 512, max_tokens)
    reference = load_model(model_dir, dtype=torch.float32, weights="bf16")
    results = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        for fmt in formats:
            int4_symmetric = symmetric and fmt == "int4"
            conversion = quantize_checkpoint(
                model_dir, Path(tmp) / fmt, fmt, group_size, int4_symmetric, True
            )
            quality = compare_models(reference, load_model(Path(tmp) / fmt, dtype=torch.float32), windows)
            results.append((fmt, conversion, quality))
    if as_json:
        print(json.dumps([_weights_row(label, c, q, per_layer=True) for label, c, q in results], indent=2))
        return
    print(
        f"{model_dir}: {results[0][2].tokens} evaluation tokens, float32 compute; reference = the "
        f"checkpoint's own weights (perplexity {results[0][2].reference_perplexity:.3f})"
    )
    print(
        f"{'weights':<10}{'MB':>8}{'x src':>7}{'linear x bf16':>15}{'layer err mean':>16}{'max':>8}"
        f"{'KL (nats)':>11}{'top-1':>8}{'ppl':>9}{'Δppl':>8}"
    )
    for label, c, q in results:
        row = _weights_row(label, c, q, per_layer=False)
        errors = list(q.layer_errors.values())
        mean = f"{sum(errors) / len(errors):.4f}" if errors else "-"
        peak = f"{max(errors):.4f}" if errors else "-"
        linear = f"{row['linear_ratio_vs_bf16']:.3f}" if row["linear_ratio_vs_bf16"] else "-"
        print(
            f"{label:<10}{c.output_bytes / 1e6:>8.2f}{c.ratio:>7.3f}{linear:>15}{mean:>16}{peak:>8}"
            f"{q.kl:>11.2e}{q.top1:>8.4f}{q.perplexity:>9.3f}{q.perplexity - q.reference_perplexity:>+8.3f}"
        )
    if per_layer:
        for label, _, q in results:
            for name, err in q.layer_errors.items():
                print(f"{label:<10}{name:<45}{err:.5f}")


def _weights_row(label, conversion, quality, per_layer: bool) -> dict:
    ratio = (
        conversion.converted_bytes / conversion.converted_bf16_bytes
        if conversion.converted_bf16_bytes
        else None
    )
    row = {
        "weights": label,
        "bytes": conversion.output_bytes,
        "source_bytes": conversion.source_bytes,
        "linear_ratio_vs_bf16": ratio,
        "kl": quality.kl,
        "top1": quality.top1,
        "perplexity": quality.perplexity,
        "reference_perplexity": quality.reference_perplexity,
        "tokens": quality.tokens,
    }
    if per_layer:
        row["layer_errors"] = quality.layer_errors
    return row

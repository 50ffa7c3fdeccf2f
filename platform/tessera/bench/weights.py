"""``tessera bench weights``: quality and size of fp8/int4 weights against the checkpoint's own.

Converts the model with ``tessera quantize`` into a temporary folder per format, then runs each converted
model and the original (float32 compute, so only weight error shows) over the same text: per-layer
relative error, logit KL, top-1 agreement and perplexity.

Speed: greedy decode tok/s of one request (``decode_batch``: that many at once) per format on the engine in
its compute dtype (``dtype="auto"``), the unquantised checkpoint as the baseline, in rounds that alternate
the formats so other load on the machine hits them alike; each round gives one ratio to the baseline.
With ``reference_kernels`` the quantised formats also run on the per-call dequantising references
(``TESSERA_KERNELS=reference``): the speed before prepared weights.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
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
    decode_tokens: int = 0,
    decode_batch: int = 1,
    rounds: int = 3,
    reference_kernels: bool = False,
) -> None:
    """``symmetric`` applies to int4 only; without ``text_files``, a few standard-library modules.
    ``decode_tokens`` > 0 also measures decode speed."""
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
        speed = None
        if decode_tokens > 0:
            paths = {fmt: Path(tmp) / fmt for fmt in formats if fmt != "bf16"}
            speed = decode_speed(
                model_dir, paths, windows[0][:32], decode_tokens, decode_batch, rounds, reference_kernels
            )
    if as_json:
        rows = [_weights_row(label, c, q, per_layer=True) for label, c, q in results]
        print(json.dumps({"quality": rows, "decode": speed} if speed else rows, indent=2))
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
    if speed:
        _print_speed(speed)
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


def decode_speed(
    model_dir: Path,
    quantized: dict[str, Path],
    prompt: list[int],
    max_tokens: int,
    batch: int,
    rounds: int,
    reference_kernels: bool,
) -> dict:
    """Decode tok/s per weight format, each round over every format in turn (rotated), and each quantised
    format's ratio to the unquantised checkpoint's speed in the same round."""
    import os
    from datetime import date

    import torch

    from gpu_workers import Engine, EngineConfig, SamplingParams
    from gpu_workers.kernels import KERNELS_ENV
    from tessera.bench.stats import spread

    config = EngineConfig(kv_budget_bytes=64 * 2**20)
    sides: dict[str, tuple[Engine, str]] = {"checkpoint": (Engine.from_pretrained(model_dir, config), "auto")}
    for fmt, path in quantized.items():
        engine = Engine.from_pretrained(path, config)
        sides[fmt] = (engine, "auto")
        if reference_kernels:
            sides[f"{fmt} (reference)"] = (engine, "reference")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = os.environ.get(KERNELS_ENV)

    def tok_s(engine: Engine, kernels: str) -> float:
        os.environ[KERNELS_ENV] = kernels
        start = time.perf_counter()
        outputs = engine.generate([prompt] * batch, params)
        return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)

    try:
        for engine, kernels in sides.values():
            tok_s(engine, kernels)  # warm-up: prepares the weights, pays one-off costs
        names = list(sides)
        speeds: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                speeds[name].append(tok_s(*sides[name]))
    finally:
        if before is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = before
    base = speeds["checkpoint"]
    engine = sides["checkpoint"][0]
    return {
        "date": date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "dtype": engine.dtype.name,
        "batch": batch,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "tok_s": {name: spread(values) for name, values in speeds.items()},
        "vs_checkpoint": {
            name: spread([v / b for v, b in zip(values, base, strict=True)])
            for name, values in speeds.items()
            if name != "checkpoint"
        },
    }


def _print_speed(speed: dict) -> None:
    from tessera.bench.stats import format_ratio, format_spread

    print(
        f"decode, {speed['dtype']} compute, {speed['batch']} request(s) x {speed['max_tokens']} tokens, "
        f"{speed['rounds']} rounds ({speed['machine']}): median [min, max]"
    )
    print(f"{'weights':<22}{'tok/s':>22}{'x checkpoint':>22}")
    for name, tok in speed["tok_s"].items():
        ratio = speed["vs_checkpoint"].get(name)
        shown = format_ratio(ratio) if ratio else "1.00x"
        print(f"{name:<22}{format_spread(tok, '.1f'):>22}{shown:>22}")

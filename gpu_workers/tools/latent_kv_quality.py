"""MLA's FP8 latent KV layouts against bf16 latent KV: next-token KL and top-1 agreement on held-out text.

Layouts (``KVSpec`` of ``DeepseekV3ForCausalLM.cache_entry``): the whole latent + rope entry in e4m3 under
the page scale, and the latent in e4m3 with the rope key in bf16 (``rope_bf16``). Each held-out stdlib
file is scored through the engine's paged forward (``engine.runner.forward_sequence``, chunks of 64 so
most reads go through the cache) once per layout, the model itself unchanged (fp32 compute), and compared
with the bf16 latent cache per token. Intervals are bootstrap 95% over files, as ``tessera eval quality``.

    python -m gpu_workers.tools.latent_kv_quality MODEL_DIR [--max-files N] [--tokens-per-file N]
    python -m gpu_workers.tools.latent_kv_quality --write-random DIR  # a tiny random MLA checkpoint
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from gpu_workers.engine.runner import forward_sequence
from gpu_workers.formats.fp8 import FP8_DTYPE
from gpu_workers.kv import KVCache
from gpu_workers.model import load_model
from gpu_workers.tools.capacity import hf_tensor_shapes
from gpu_workers.tools.metrics import next_token_metrics
from gpu_workers.tools.train.data import eval_windows, stdlib_corpus, token_stream

PAGE_SIZE = 16
RESAMPLES = 1000
# name -> (KV element type, rope key kept in bf16)
LAYOUTS = {
    "bf16": (torch.bfloat16, False),
    "fp8_e4m3 (whole entry)": (FP8_DTYPE, False),
    "fp8_e4m3 + rope bf16": (FP8_DTYPE, True),
}
# DeepSeek-V3's proportions scaled down: latent 128 + rope 16 (V3: 512 + 64), grouped MoE after one dense layer.
RANDOM_MLA = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def write_random_mla(out: Path, seed: int = 0) -> None:
    """A random DeepSeek-V3-shaped checkpoint with the stdlib BPE tokenizer: unit-variance linears (so
    attention is not uniform), norms at one, a zero router correction bias."""
    from gpu_workers.tools.demo_checkpoint import train_stdlib_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hf_tensor_shapes(RANDOM_MLA).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = torch.zeros(shape)
        elif "embed_tokens" in name:
            weights[name] = torch.randn(shape, generator=gen)
        else:
            gain = 4.0 if name.startswith("lm_head") else 1.0  # spread logits: a peaked next-token choice
            weights[name] = torch.randn(shape, generator=gen) * gain / math.sqrt(shape[-1])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(RANDOM_MLA, indent=2) + "\n")
    train_stdlib_tokenizer(RANDOM_MLA["vocab_size"]).save(str(out / "tokenizer.json"))


@torch.inference_mode()
def score(model, tokens: list[int], dtype: torch.dtype, rope_bf16: bool) -> torch.Tensor:
    """Log-softmax [T, vocab] of one window, every attention read through a cache of this layout."""
    model.kv_rope_bf16 = rope_bf16
    pages = -(-len(tokens) // PAGE_SIZE)
    cache = KVCache(model.kv_spec, pages, PAGE_SIZE, dtype)
    hidden = forward_sequence(model, cache, list(range(pages)), tokens, chunk_size=64)
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def measure(model_dir: Path, max_files: int | None, tokens_per_file: int | None) -> dict[str, dict]:
    model = load_model(model_dir)
    if not hasattr(model, "kv_rope_bf16"):
        raise ValueError(f"{model_dir} is a {model.config.architecture}; this compares MLA latent layouts")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    corpus = stdlib_corpus()
    files = corpus.heldout[:max_files] if max_files else corpus.heldout
    seq_len = min(model.config.max_position_embeddings, 512)
    per_file = {name: [] for name in LAYOUTS}  # (tokens, kl sum, top-1 sum, kl values)
    for text in corpus.texts(files):
        stream = token_stream(tokenizer, [text])
        if tokens_per_file:
            stream = stream[: tokens_per_file + 1]
        if len(stream) < 2:
            continue
        sums = {name: [0, 0.0, 0.0, []] for name in LAYOUTS}
        for inputs, targets in eval_windows(stream, seq_len):
            ids = inputs.tolist()
            base = score(model, ids, *LAYOUTS["bf16"])
            for name, layout in LAYOUTS.items():
                m = next_token_metrics(base, base if name == "bf16" else score(model, ids, *layout), targets)
                s = sums[name]
                s[0] += len(ids)
                s[1] += float(m.kl.sum())
                s[2] += float(m.top1.float().sum())
                s[3].append(m.kl.numpy())
        for name, s in sums.items():
            per_file[name].append(s)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(per_file["bf16"]), size=(RESAMPLES, len(per_file["bf16"])))
    result = {}
    whole = np.array([r[1] for r in per_file["fp8_e4m3 (whole entry)"]])
    for name, rows in per_file.items():
        tokens = np.array([r[0] for r in rows], dtype=float)
        kl, top1 = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
        # Paired with the whole-entry layout on the same files: negative means this layout is closer.
        kl_vs_whole = (kl - whole)[idx].sum(1) / tokens[idx].sum(1)
        kl_values = np.concatenate([v for r in rows for v in r[3]])
        spec = model.cache_entry(model.config, LAYOUTS[name][1])
        result[name] = {
            "bytes_per_token": spec.page_bytes(PAGE_SIZE, LAYOUTS[name][0]) / PAGE_SIZE,
            "kl_mean": kl.sum() / tokens.sum(),
            "kl_mean_ci95": np.percentile(kl[idx].sum(1) / tokens[idx].sum(1), [2.5, 97.5]).tolist(),
            "kl_p99": float(np.quantile(kl_values, 0.99)),
            "top1": top1.sum() / tokens.sum(),
            "top1_ci95": np.percentile(top1[idx].sum(1) / tokens[idx].sum(1), [2.5, 97.5]).tolist(),
            "kl_minus_whole_entry": (kl - whole).sum() / tokens.sum(),
            "kl_minus_whole_entry_ci95": np.percentile(kl_vs_whole, [2.5, 97.5]).tolist(),
            "files": len(rows),
            "tokens": int(tokens.sum()),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpu_workers.tools.latent_kv_quality", description=__doc__
    )
    parser.add_argument("model", type=Path, nargs="?", help="an MLA checkpoint folder with tokenizer.json")
    parser.add_argument("--write-random", type=Path, metavar="DIR", help="write a tiny random MLA checkpoint")
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--tokens-per-file", type=int, default=None)
    args = parser.parse_args(argv)
    if args.write_random:
        write_random_mla(args.write_random)
        return 0
    if args.model is None or not (args.model / "tokenizer.json").is_file():
        parser.error("give an MLA checkpoint folder holding tokenizer.json (or --write-random DIR)")
    for name in ("max_files", "tokens_per_file"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    torch.manual_seed(0)
    print(json.dumps(measure(args.model, args.max_files, args.tokens_per_file), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

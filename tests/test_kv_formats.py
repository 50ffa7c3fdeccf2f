"""KV formats: FP8-e4m3 pages (uint8 bits + per-page scales) and INT8 entries (codes + each entry's own
scale) against unquantised KV, capacity, scales; on a trained model, INT8 against FP8."""

from __future__ import annotations

import argparse
import functools
import json
import random
import sysconfig
from pathlib import Path

import pytest
import torch

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.engine.runner import forward_sequence
from gpu_workers.formats.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, fp8_scale_pow2
from gpu_workers.formats.kv_int8 import dequantize_int8_entries, hadamard, quantize_int8_entries
from gpu_workers.kv import AttentionMetadata, KVCache, KVSpec
from gpu_workers.kv.scales import KVScales
from gpu_workers.model import load_model
from gpu_workers.model.attention import PagedAttention
from gpu_workers.tokenizer import load_tokenizer
from gpu_workers.tools.calibrate import measure_kv_amax
from gpu_workers.tools.eval.heldout import heldout_texts
from gpu_workers.tools.metrics import next_token_metrics

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
PROMPT_LEN, DECODE_STEPS = 32, 24


@functools.cache
def load(path: Path):
    """Model and tokenizer of a checkpoint, loaded once: engines of every KV format share them."""
    return load_model(path, dtype=torch.float32), load_tokenizer(path)


def make_engine(path, kv_cache_dtype="auto", **overrides) -> Engine:
    config = dict(dtype="float32", kv_budget_bytes=2 * 2**20, page_size=4, kv_cache_dtype=kv_cache_dtype)
    config.update(overrides)
    return Engine(*load(path), EngineConfig(**config))


@torch.inference_mode()
def forced_logits(engine: Engine, sequences: list[list[int]]) -> torch.Tensor:
    """Next-token logits [seqs, 1 + DECODE_STEPS, vocab] of sequences fed through the engine's model and cache.

    One batched prefill of the first PROMPT_LEN tokens, then one batched decode step per further token
    (teacher forcing, so both formats see the same tokens). Page tables are scattered, like a real pool's.
    It writes the engine's cache directly, so the engine must be idle.
    """
    cache, page_size = engine.cache, engine.cache.page_size
    per_seq = -(-(PROMPT_LEN + DECODE_STEPS) // page_size)
    pages = list(range(per_seq * len(sequences)))
    random.Random(0).shuffle(pages)
    tables = [pages[i * per_seq : (i + 1) * per_seq] for i in range(len(sequences))]
    logits, fed = [], 0
    for n in [PROMPT_LEN] + [1] * DECODE_STEPS:
        ids = [t for seq in sequences for t in seq[fed : fed + n]]
        positions = [p for _ in sequences for p in range(fed, fed + n)]
        meta = AttentionMetadata.build(tables, [fed + n] * len(sequences), [n] * len(sequences), page_size)
        hidden = engine.model(torch.tensor(ids), torch.tensor(positions), PagedAttention(cache, meta))
        last = torch.arange(1, len(sequences) + 1) * n - 1
        logits.append(engine.model.compute_logits(hidden[last]))
        fed += n
    return torch.stack(logits, dim=1)


def divergence(reference: torch.Tensor, test: torch.Tensor) -> dict[str, float]:
    """Per-token KL(reference || test) of next-token distributions, top-1 agreement, max logit error."""
    log_p, log_q = reference.log_softmax(-1), test.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1": (reference.argmax(-1) == test.argmax(-1)).float().mean().item(),
        "max_logit_err": (reference - test).abs().max().item(),
    }


def demo_sequences(path: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(path)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text()[2000:5000] for name in ("difflib.py", "pprint.py", "shlex.py")]
    return [tokenizer.encode(text)[: PROMPT_LEN + DECODE_STEPS] for text in texts]


def random_sequences(n: int, vocab: int = 120) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, vocab) for _ in range(PROMPT_LEN + DECODE_STEPS)] for _ in range(n)]


# -- quality: FP8 KV against the unquantised (float32) cache, same checkpoint and tokens ---------------
#
# Measured (torch 2.13 CPU; 3 stdlib-text sequences for the demo checkpoint, 4 random ones for tiny-llama;
# 32-token prefill + 24 teacher-forced decode steps = 75 and 100 next-token distributions):
#   demo (vocab 2048, 4 layers):  fp8  KL mean 6.4e-5, max 1.3e-4, top-1 0.973, max logit err 0.056
#                                 bf16 KL mean 1.4e-7, max 6.4e-7, top-1 1.000, max logit err 0.0023
#   tiny-llama (vocab 128):       fp8  KL mean 7.8e-5, max 2.9e-4, top-1 0.970, max logit err 0.078
#                                 bf16 KL mean 3.5e-7, max 1.1e-6, top-1 1.000, max logit err 0.0036
# (FP8 against BF16 KV directly: the same as FP8 against float32 to two digits.) FP8's logit error is
# ~20x BF16's, as e4m3's 3 mantissa bits against bf16's 7 predict. These random-weight models have
# nearly flat next-token distributions (entropy 7.57 of at most 7.62 nats for the demo, 4.05 of 4.85 for
# tiny-llama), so top-1 near-ties flip on a 0.05 logit error: the top-1 agreement here is a floor, not
# what a trained model with peaked distributions shows. Thresholds: KL and logit error ~3-5x the measured
# values (room for other CPUs/BLAS builds, still far below a broken scale or a wrong page, which moves
# logits by O(1), see the squeezed-scales check below); top-1 a few flips below the measured rate.
THRESHOLDS = {
    "demo": {"kl_mean": 3e-4, "kl_max": 1e-3, "top1": 0.9, "max_logit_err": 0.2},
    "tiny": {"kl_mean": 3e-4, "kl_max": 1e-3, "top1": 0.92, "max_logit_err": 0.25},
}
# INT8 entries, same sequences (measured): demo KL mean 1.9e-6, max logit err 0.010; tiny-llama 2.4e-6, 0.013;
# ~30x below FP8's KL. Thresholds ~4x and ~3x the measured values.
INT8_THRESHOLDS = {
    "demo": {"kl_mean": 1e-5, "max_logit_err": 0.04},
    "tiny": {"kl_mean": 1e-5, "max_logit_err": 0.04},
}


@pytest.fixture(scope="module")
def checkpoints(demo_model_dir, tiny_llama_dir):
    """Per checkpoint: its folder, the sequences fed, and the unquantised cache's logits for them."""
    cases = {
        "demo": (demo_model_dir, demo_sequences(demo_model_dir)),
        "tiny": (tiny_llama_dir, random_sequences(4)),
    }
    return {
        name: (path, sequences, forced_logits(make_engine(path, "auto"), sequences))
        for name, (path, sequences) in cases.items()
    }


@pytest.mark.parametrize("name", ["demo", "tiny"])
def test_fp8_kv_stays_close_to_unquantised_kv(checkpoints, name):
    path, sequences, reference = checkpoints[name]
    fp8 = forced_logits(make_engine(path, "fp8_e4m3"), sequences)
    bf16 = forced_logits(make_engine(path, "bf16"), sequences)
    measured, baseline = divergence(reference, fp8), divergence(reference, bf16)
    limits = THRESHOLDS[name]
    assert measured["kl_mean"] <= limits["kl_mean"], measured
    assert measured["kl_max"] <= limits["kl_max"], measured
    assert measured["top1"] >= limits["top1"], measured
    assert measured["max_logit_err"] <= limits["max_logit_err"], measured
    # The comparison is sensitive: BF16 KV is measurably closer than FP8, and FP8 is not exact.
    assert baseline["max_logit_err"] * 4 < measured["max_logit_err"], (baseline, measured)


@pytest.mark.parametrize("name", ["demo", "tiny"])
def test_int8_kv_stays_closer_to_unquantised_kv_than_fp8(checkpoints, name):
    path, sequences, reference = checkpoints[name]
    int8 = divergence(reference, forced_logits(make_engine(path, "int8"), sequences))
    fp8 = divergence(reference, forced_logits(make_engine(path, "fp8_e4m3"), sequences))
    assert int8["kl_mean"] <= INT8_THRESHOLDS[name]["kl_mean"], int8
    assert int8["max_logit_err"] <= INT8_THRESHOLDS[name]["max_logit_err"], int8
    assert int8["kl_mean"] * 4 < fp8["kl_mean"], (int8, fp8)


def test_int8_engine_generates_and_stores_entries_with_their_scales(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, "int8")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = engine.generate(random_sequences(3), params)
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outputs)
    assert engine.cache.k.dtype == torch.int8 and engine.cache.k.shape[-1] == 16 + 2
    assert engine.cache.k_scale is None and engine.cache.layer_scales(0) == (None, None)
    assert engine.stats()["kv_pages_used"] == 0


def test_int8_entries_do_not_depend_on_prefill_chunking_or_batch(tiny_llama_dir):
    # Each entry's scale is its own: one 56-token chunk or 12-token chunks shared by 12 prompts store the
    # same bytes for the same tokens, and generate the same tokens.
    prompts = random_sequences(12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    whole = make_engine(tiny_llama_dir, "int8", max_num_batched_tokens=1024).generate(prompts, params)
    chunked = make_engine(tiny_llama_dir, "int8", max_num_batched_tokens=12).generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    k = torch.randn(6, 2, 16)
    assert torch.equal(quantize_int8_entries(k)[2:4], quantize_int8_entries(k[2:4]))


def test_int8_keys_are_stored_rotated_and_read_by_rotated_queries():
    # head_dim 24: Hadamard blocks of 8. Scores through the rotation equal q . k to float rounding; the
    # stored keys are the rotated ones, within half a code of their entry's amax / 127.
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=24)
    cache = KVCache(spec, num_pages=2, page_size=4, dtype=torch.int8)
    assert cache.key_block == 8
    gen = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(5, 2, 24, generator=gen) for _ in range(3))
    k[:, :, 3] += 20.0  # one loud channel, as RoPE's slow pairs make
    cache.write(0, k, v, torch.arange(5))
    k_slots, v_slots = cache.layer(0)
    rotated = hadamard(k, 8)
    assert torch.allclose(hadamard(rotated, 8), 8 * k, atol=1e-4)
    stored = dequantize_int8_entries(k_slots[:5], torch.float32)
    step = rotated.abs().amax(-1, keepdim=True) / 127
    assert ((stored - rotated).abs() <= step * (0.5 + 2**-8)).all()
    # The loud channel spreads over its block: relative to the entry's length, its amax (what sets the
    # code step) drops from ~0.97 to ~0.4.
    peak = rotated.abs().amax(-1) / rotated.norm(dim=-1)
    assert (peak < 0.5 * k.abs().amax(-1) / k.norm(dim=-1)).all()
    queries, scale = cache.queries(q, 0.25)
    assert scale == 0.25 / 8
    through = torch.einsum("thd,shd->ths", queries, rotated) * scale
    assert torch.allclose(through, torch.einsum("thd,shd->ths", q, k) * 0.25, atol=1e-4)
    assert torch.equal(
        dequantize_int8_entries(v_slots[:5], torch.float32),
        dequantize_int8_entries(quantize_int8_entries(v), torch.float32),
    )  # values as they are


def test_fp8_engine_generates_and_stores_uint8_pages(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, "fp8_e4m3")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = engine.generate(random_sequences(3), params)
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outputs)
    assert engine.cache.k.dtype == torch.uint8 and engine.cache.v.dtype == torch.uint8
    assert engine.stats()["kv_pages_used"] == 0


# -- saturation ---------------------------------------------------------------------------------------


def read_back(cache: KVCache, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k_slots, v_slots = cache.layer(layer)
    k_scale, v_scale = cache.layer_scales(layer)
    pages = slots // cache.page_size
    k = dequantize_fp8(k_slots[slots], k_scale[pages][:, None, None], torch.float32)
    v = dequantize_fp8(v_slots[slots], v_scale[pages][:, None, None], torch.float32)
    return k, v


@pytest.mark.parametrize(
    "scale",
    [
        1.0,
        2.0**-9,
        3.7,
        torch.tensor([[2.0**-7], [4.0]]),  # powers of two: bf16 holds the factor, the fast bf16 path
        torch.tensor([[0.013], [4.0]]),
        torch.tensor([[0.013], [256.0]]),
    ],
)
def test_the_cpu_fp8_decode_equals_torchs_cast_for_every_stored_bit_pattern(scale):
    bits = torch.arange(256, dtype=torch.uint8).repeat(2, 1)  # every e4m3 value, subnormals and -0 included
    stored = (bits != 0x7F) & (bits != 0xFF)  # NaN: the quantiser saturates, so no page holds it
    want = bits.view(FP8_DTYPE).float() * scale
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_fp8(bits, scale, dtype)
        assert got.dtype == dtype
        assert torch.equal(got[stored], want.to(dtype)[stored])
        assert torch.equal(got[stored].signbit(), want[stored].signbit())  # -0.0 stays negative
    typed = dequantize_fp8(bits.view(FP8_DTYPE), scale, torch.float32)  # bits typed as fp8 read the same
    assert torch.equal(typed[stored], want[stored])


def test_values_beyond_the_fp8_range_saturate_never_inf_or_nan():
    scales = KVScales.from_amax([0.5, 0.5], [0.25, 0.25], tokens=1)
    cache = KVCache(SPEC, num_pages=2, page_size=4, dtype=FP8_DTYPE, scales=scales)
    huge = torch.tensor([1e6, -1e6, 1e30, -float("inf"), float("inf"), 3.0, -3.0, 0.1])
    x = huge.repeat(4, 2, 1)  # 4 tokens x 2 heads x 8 dims
    slots = torch.arange(4)
    cache.write(0, x, x, slots)
    k, v = read_back(cache, 0, slots)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    k_limit, v_limit = 448 * scales.k_scale[0], 448 * scales.v_scale[0]
    assert torch.allclose(k[..., :5], torch.tensor([1, -1, 1, -1, 1]) * k_limit)
    assert torch.allclose(v[..., :7], torch.tensor([1, -1, 1, -1, 1, 1, -1]) * v_limit)
    assert torch.allclose(k[..., 7], torch.tensor(0.1), rtol=0.07)  # in range: e4m3's ~6% step


def pow2_scale(amax: float) -> float:
    scale = fp8_scale_pow2(torch.tensor(amax)).item()
    assert amax / FP8_MAX <= scale < 2 * amax / FP8_MAX
    return scale


def test_a_decode_token_beyond_its_pages_dynamic_scale_saturates():
    cache = KVCache(SPEC, num_pages=2, page_size=4, dtype=FP8_DTYPE)
    prompt = torch.rand(2, 2, 8, generator=torch.Generator().manual_seed(0))  # amax < 1 sets the scale
    meta = AttentionMetadata.build([[1]], [2], [2], page_size=4)
    cache.write(0, prompt, prompt, meta.slot_mapping, meta.spans)
    scale = cache.k_scale[0, 1].item()
    assert scale == pow2_scale(prompt.abs().max().item())
    spike = torch.full((1, 2, 8), 1e9)
    meta = AttentionMetadata.build([[1]], [3], [1], page_size=4)  # slot 2 of the open page
    cache.write(0, spike, -spike, meta.slot_mapping, meta.spans)
    k, v = read_back(cache, 0, meta.slot_mapping)
    assert torch.equal(k, torch.full_like(k, 448 * scale))
    assert torch.equal(v, torch.full_like(v, -448 * cache.v_scale[0, 1].item()))
    assert cache.k_scale[0, 1].item() == scale  # an open page keeps its scale


# -- dynamic scales: per sequence, kept per page ------------------------------------------------------


def test_dynamic_scales_are_per_sequence_and_pages_keep_the_scale_they_were_written_with():
    cache = KVCache(SPEC, num_pages=8, page_size=4, dtype=FP8_DTYPE)
    small, large = torch.full((8, 2, 8), 0.5), torch.full((6, 2, 8), 40.0)
    # Sequences A (8 tokens, pages 3 and 5) and B (6 tokens, pages 0 and 7) prefill in one step.
    meta = AttentionMetadata.build([[3, 5], [0, 7]], [8, 6], [8, 6], page_size=4)
    cache.write(0, torch.cat([small, large]), torch.cat([small, large]), meta.slot_mapping, meta.spans)
    a_scale, b_scale = pow2_scale(0.5), pow2_scale(40.0)
    assert cache.k_scale[0, [3, 5]].tolist() == pytest.approx([a_scale] * 2)
    assert cache.k_scale[0, [0, 7]].tolist() == pytest.approx([b_scale] * 2)
    # A decodes into a new page with a smaller value: the page inherits A's scale.
    meta = AttentionMetadata.build([[3, 5, 2]], [9], [1], page_size=4)
    cache.write(0, torch.full((1, 2, 8), 0.1), torch.full((1, 2, 8), 0.1), meta.slot_mapping, meta.spans)
    assert cache.k_scale[0, 2].item() == pytest.approx(a_scale)
    # C shares A's first two pages as a cached prefix and writes larger values: its own pages get a
    # larger scale, the shared pages keep A's, so A still reads what it wrote.
    before = read_back(cache, 0, torch.arange(12, 16))[0]
    meta = AttentionMetadata.build([[3, 5, 6]], [12], [4], page_size=4)
    cache.write(0, torch.full((4, 2, 8), 3.0), torch.full((4, 2, 8), 3.0), meta.slot_mapping, meta.spans)
    assert cache.k_scale[0, 6].item() == pow2_scale(3.0)
    assert cache.k_scale[0, [3, 5]].tolist() == pytest.approx([a_scale] * 2)
    assert torch.equal(read_back(cache, 0, torch.arange(12, 16))[0], before)
    assert torch.allclose(read_back(cache, 0, torch.arange(24, 28))[0], torch.tensor(3.0))


def test_dynamic_fp8_outputs_do_not_depend_on_prefill_chunking(tiny_llama_dir):
    # Every prompt in one 56-token chunk, against 12-token chunks shared by 12 prompts: the first chunk, whose
    # amax sets each sequence's scale, differs. With power-of-two scales all 12 outputs match; with
    # scale = amax / 448 exactly, 2 of the 12 diverge (measured), so this test sees the difference.
    prompts = random_sequences(12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    whole = make_engine(tiny_llama_dir, "fp8_e4m3", max_num_batched_tokens=1024).generate(prompts, params)
    chunked = make_engine(tiny_llama_dir, "fp8_e4m3", max_num_batched_tokens=12).generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


# -- capacity: the same byte budget holds ~2x the tokens in FP8 ----------------------------------------


def test_pages_for_budget_counts_scale_bytes():
    budget = 1 << 20
    fp8_page = KVCache.page_bytes(SPEC, 16, FP8_DTYPE)
    assert fp8_page == 16 * SPEC.bytes_per_token(torch.uint8) + 2 * SPEC.num_layers * 4
    pages = KVCache.pages_for_budget(SPEC, budget, 16, FP8_DTYPE)
    assert pages == budget // fp8_page
    assert (
        KVCache(SPEC, pages, 16, FP8_DTYPE).nbytes <= budget < KVCache(SPEC, pages + 1, 16, FP8_DTYPE).nbytes
    )


def fill(path, kv_cache_dtype: str, budget: int) -> dict[str, int]:
    """Serve 80 requests of 28 + 4 tokens under one KV budget; the peak of what ran at once."""
    engine = make_engine(
        path,
        kv_cache_dtype,
        kv_budget_bytes=budget,
        page_size=16,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
    )
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(80):
        engine.add_request([rng.randrange(2, 120) for _ in range(28)], params, request_id=f"r{i}")
    peak = {"running": 0, "tokens": 0}
    finished = 0
    while engine.has_unfinished():
        finished += sum(e.finish_reason == "length" for e in engine.step())
        stats = engine.stats()
        peak["running"] = max(peak["running"], stats["running"])
        peak["tokens"] = max(peak["tokens"], sum(s.num_tokens for s in engine.scheduler.running))
    assert finished == 80 and engine.stats()["kv_pages_used"] == 0
    assert engine.cache.nbytes <= budget
    return {**peak, "capacity": engine.stats()["kv_capacity_tokens"]}


def test_int8_pages_cost_their_entries_scales_included():
    # An entry is head_dim codes and a 2-byte scale: 10 bytes for SPEC's head_dim 8, no per-page extra.
    page = KVCache.page_bytes(SPEC, 16, torch.int8)
    assert page == 16 * 2 * SPEC.num_layers * SPEC.num_kv_heads * (SPEC.head_dim + 2)
    pages = KVCache.pages_for_budget(SPEC, 1 << 20, 16, torch.int8)
    cache = KVCache(SPEC, pages, 16, torch.int8)
    assert cache.nbytes == pages * page <= 1 << 20 < (pages + 1) * page
    assert cache.bytes_per_token == page / 16


def test_fp8_admits_at_least_1_9x_the_tokens_of_bf16_in_the_same_budget(tiny_llama_dir):
    # tiny-llama: 2 layers x 2 KV heads x 16 dims. BF16: 256 bytes/token; FP8: 128 + 16 bytes of scales
    # per 16-token page. 64 BF16 pages; FP8 fits 127 (1.98x). Each request holds 2 pages (28 + 4 tokens).
    budget = 64 * 16 * 256
    bf16 = fill(tiny_llama_dir, "bf16", budget)
    fp8 = fill(tiny_llama_dir, "fp8_e4m3", budget)
    assert bf16["capacity"] == 64 * 16
    assert fp8["capacity"] >= 1.9 * bf16["capacity"]
    assert fp8["running"] >= 1.9 * bf16["running"], (bf16, fp8)
    assert fp8["tokens"] >= 1.9 * bf16["tokens"], (bf16, fp8)


# -- static scales: calibrate, save, load, use -----------------------------------------------------------


@pytest.fixture(scope="module")
def demo_scales_file(demo_model_dir, tmp_path_factory):
    from gpu_workers.tools.calibrate import calibrate

    path = tmp_path_factory.mktemp("scales") / "scales.json"
    calibrate(demo_model_dir, max_tokens=512, window=256).save(path)
    return path


def test_scales_file_round_trips(demo_scales_file, tmp_path):
    scales = KVScales.load(demo_scales_file)
    assert scales.num_layers == 4 and scales.tokens == 512
    assert all(s == pytest.approx(a / FP8_MAX) for s, a in zip(scales.k_scale, scales.k_amax, strict=True))
    scales.save(tmp_path / "copy.json")
    assert KVScales.load(tmp_path / "copy.json") == scales
    raw = json.loads(demo_scales_file.read_text())
    assert raw["format"] == "tessera-kv-scales/1" and raw["fp8_max"] == 448.0


def test_static_scales_are_used_and_never_change(checkpoints, demo_scales_file, tmp_path):
    path, sequences, reference = checkpoints["demo"]
    scales = KVScales.load(demo_scales_file)
    engine = make_engine(path, "fp8_e4m3", kv_scales=str(demo_scales_file))
    static = forced_logits(engine, sequences)
    for layer in range(scales.num_layers):
        assert engine.cache.k_scale[layer].eq(torch.tensor(scales.k_scale[layer])).all()
        assert engine.cache.v_scale[layer].eq(torch.tensor(scales.v_scale[layer])).all()
    measured = divergence(reference, static)
    # Measured: KL mean 4.1e-5, max 6.2e-5, top-1 0.933, max logit err 0.044 (calibrated amax ~1.45).
    assert measured["kl_mean"] <= THRESHOLDS["demo"]["kl_mean"], measured
    assert measured["max_logit_err"] <= THRESHOLDS["demo"]["max_logit_err"], measured
    # A file whose scales are 100x too small saturates most of K and V: the engine reads the file.
    squeezed = KVScales.from_amax([a / 100 for a in scales.k_amax], [a / 100 for a in scales.v_amax], 1)
    squeezed.save(tmp_path / "squeezed.json")
    engine = make_engine(path, "fp8_e4m3", kv_scales=str(tmp_path / "squeezed.json"))
    assert divergence(static, forced_logits(engine, sequences))["max_logit_err"] > 1.0


def test_measure_kv_amax_sees_every_layer(tiny_llama_dir):
    from gpu_workers.model import load_model

    model = load_model(tiny_llama_dir)
    k_amax, v_amax, tokens = measure_kv_amax(model, random_sequences(2), window=40)
    assert tokens == 2 * (PROMPT_LEN + DECODE_STEPS)
    assert len(k_amax) == len(v_amax) == 2 and min(k_amax + v_amax) > 0


def test_calibrate_command_writes_a_scales_file(demo_model_dir, tmp_path):
    from tessera.cli.kv import add_commands

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    sample = tmp_path / "sample.txt"
    sample.write_text("def add(a, b):\n    return a + b\n" * 20)
    out = tmp_path / "scales.json"
    args = parser.parse_args(["calibrate", str(demo_model_dir), "--out", str(out), "--text", str(sample)])
    args.func(args)
    scales = KVScales.load(out)
    assert scales.num_layers == 4 and 0 < scales.tokens <= 8192


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(kv_cache_dtype="int8", kv_scales="scales.json"), "fp8_e4m3"),
        (dict(kv_cache_dtype="bf16", kv_scales="scales.json"), "fp8_e4m3"),
    ],
)
def test_bad_kv_settings_are_clear_errors(config, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**config)


def test_scales_for_another_model_are_refused(tiny_llama_dir, demo_scales_file):
    with pytest.raises(ValueError, match="layers"):
        make_engine(tiny_llama_dir, "fp8_e4m3", kv_scales=str(demo_scales_file))
    with pytest.raises(ValueError, match="does not exist"):
        make_engine(tiny_llama_dir, "fp8_e4m3", kv_scales="/nonexistent/scales.json")


# -- a trained model: INT8 KV against FP8 KV ------------------------------------------------------------
#
# pycode-tiny (the shipped model), fp32, 4 held-out stdlib files x 256 tokens scored in 64-token chunks
# through the cache, against an fp32 cache (measured): bf16 KV KL 5e-6, top-1 99.8%; INT8 KL 5.5e-5, top-1
# 99.9%; FP8-e4m3 KL 1.4e-3, top-1 98.1%. On 8 x 512 tokens: INT8 6.9e-5 / 99.3%, FP8 1.7e-3 / 97.1%. FP8's
# error is e4m3's 3 mantissa bits on K (BENCHMARKS.md, "FP8 KV quality on a real model"); the thresholds
# sit ~5x above INT8 and ~5x below FP8, so an 8-bit KV format as lossy as FP8 fails here.


def test_int8_kv_keeps_a_trained_models_next_token_distributions():
    model_dir = Path(__file__).resolve().parents[1] / "models" / "pycode-tiny"
    model, tokenizer = load(model_dir)
    windows = [tokenizer.encode(text)[:256] for text in heldout_texts([model_dir], max_files=4).values()]

    @torch.inference_mode()
    def logprobs(kv_dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
        pages = -(-len(ids) // 16)
        cache = KVCache(model.kv_spec, pages, 16, kv_dtype)
        hidden = forward_sequence(model, cache, list(range(pages)), ids, chunk_size=64)
        return model.compute_logits(hidden)[:-1].float().log_softmax(-1)

    kl, top1, tokens = 0.0, 0.0, 0
    for ids in windows:
        m = next_token_metrics(logprobs(torch.float32, ids), logprobs(torch.int8, ids), torch.tensor(ids[1:]))
        kl, top1, tokens = kl + m.kl.sum().item(), top1 + m.top1.sum().item(), tokens + len(ids) - 1
    assert tokens > 900
    assert kl / tokens < 3e-4 and top1 / tokens > 0.99, (kl / tokens, top1 / tokens)

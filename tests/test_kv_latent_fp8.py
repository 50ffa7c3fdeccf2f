"""MLA's FP8 latent layouts: the whole 576-value entry in e4m3, or the latent in e4m3 and the rope key in bf16.

The rope-in-bf16 layout (``KVSpec.bf16_tail``, selected by ``DeepseekV3ForCausalLM.kv_rope_bf16``) stores
each entry as its e4m3 latent followed by the rope key's bf16 bytes, under a page scale taken from the
latent alone. Proven here on the real write and read paths: the rope key comes back bit for bit, the pool
allocates what ``tessera capacity`` plans, and prefill -> hand-off -> decode equals one engine.
"""

from __future__ import annotations

import pytest
import torch

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.checkpoint import ModelConfig
from gpu_workers.formats.fp8 import FP8_DTYPE, dequantize_fp8_entry, fp8_scale_pow2
from gpu_workers.kv import KVCache, KVSpec, transfer
from gpu_workers.model import load_model
from gpu_workers.model.deepseek_v3 import latent_kv_spec
from gpu_workers.tools import capacity as cap
from tests.hf_models import PAGE_SIZE, random_tokens, run_paged, save_tiny
from tests.test_capacity_engine import allocated_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LAYERS, RANK, ROPE = 3, 16, 8  # the tiny deepseek_v3 checkpoint's latent entry


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))


def engine(path, rope_bf16: bool, kv: str = "fp8_e4m3") -> Engine:
    model = load_model(path)
    model.kv_rope_bf16 = rope_bf16
    model.fuse_projections()
    config = EngineConfig(dtype="float32", kv_cache_dtype=kv, kv_budget_bytes=2**20, page_size=PAGE_SIZE)
    return Engine(model, None, config)


def test_the_rope_tail_is_stored_in_bf16_and_the_page_scale_covers_the_latent_only():
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=12, v_is_k=True, bf16_tail=4)
    cache = KVCache(spec, num_pages=2, page_size=4, dtype=FP8_DTYPE)
    assert cache.k.shape[-1] == 8 + 2 * 4  # 8 e4m3 bytes, then 4 bf16 values
    x = torch.randn(6, 1, 12)
    x[..., 8:] *= 1000  # a rope key far outside the latent's range must not coarsen the latent's scale
    cache.write(0, x, x, torch.arange(6))
    assert torch.equal(cache.k_scale[0], fp8_scale_pow2(x[..., :8].abs().amax()).expand(2))
    bits, _ = cache.layer(0)
    back = dequantize_fp8_entry(bits[:6], cache.k_scale[0, 0], torch.float32, 12)
    assert torch.equal(back[..., 8:], x[..., 8:].to(torch.bfloat16).float())
    torch.testing.assert_close(back[..., :8], x[..., :8], rtol=0.07, atol=0.01)


def test_kimi_k2_rope_bf16_layout_is_640_bytes_per_layer_plus_its_page_scale():
    config = ModelConfig.from_dict(cap.NAMED_CONFIGS["Kimi-K2"])
    whole, rope_bf16 = latent_kv_spec(config), latent_kv_spec(config, rope_bf16=True)
    assert rope_bf16.page_bytes(16, FP8_DTYPE) / 16 == 61 * (512 + 2 * 64) + 61 * 4 / 16 == 39_055.25
    assert whole.page_bytes(16, FP8_DTYPE) / 16 == 61 * 576 + 61 * 4 / 16
    # Below the published FP8 MLA layout's 656 bytes (512 e4m3, 4 fp32 scales per 128 values, 64 bf16).
    assert rope_bf16.page_bytes(16, FP8_DTYPE) / 16 / 61 < 512 + 4 * 4 + 2 * 64
    assert cap.named_model("Kimi-K2").kv.rope_bf16_bytes_per_token() == 39_055.25


def test_rope_bf16_pool_allocates_what_the_planner_says(checkpoint):
    served = engine(checkpoint.path, rope_bf16=True)
    measured = allocated_bytes(served.cache) / served.cache.capacity_tokens
    assert measured == cap.checkpoint_model(checkpoint.path).kv.rope_bf16_bytes_per_token(page_size=PAGE_SIZE)
    assert measured == LAYERS * (RANK + 2 * ROPE) + LAYERS * 4 / PAGE_SIZE
    # An unquantised cache has nothing to keep apart: the option changes only FP8.
    assert engine(checkpoint.path, rope_bf16=True, kv="bf16").cache.k.shape[-1] == RANK + ROPE


def test_first_layer_rope_keys_are_bit_for_bit_the_bf16_cache_s(checkpoint):
    # Layer 0's entries depend on the embeddings alone, so both caches were given the same values.
    model = load_model(checkpoint.path)
    prompt = random_tokens(12, seed=3)
    caches = {}
    for name, rope_bf16, dtype in (("fp8", True, FP8_DTYPE), ("bf16", False, torch.bfloat16)):
        model.kv_rope_bf16 = rope_bf16
        cache = KVCache(model.kv_spec, 8, PAGE_SIZE, dtype)
        run_paged_into(model, cache, prompt)
        caches[name] = cache
    fp8_bits, _ = caches["fp8"].layer(0)
    bf16_entries, _ = caches["bf16"].layer(0)
    rope = fp8_bits[: len(prompt), :, RANK:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, bf16_entries[: len(prompt), :, RANK:])
    assert rope.abs().sum() > 0


def run_paged_into(model, cache: KVCache, prompt: list[int]) -> None:
    from gpu_workers.engine.runner import forward_sequence

    forward_sequence(model, cache, list(range(cache.num_pages)), prompt, chunk_size=5)


def test_rope_bf16_logits_stay_close_to_exact_latent_kv(checkpoint):
    model = load_model(checkpoint.path)
    prompt = random_tokens(20, seed=1)
    schedule = [[(0, 7)], [(0, 6)]] + [[(0, 1)]] * 7
    [exact] = run_paged(model, [prompt], schedule)
    model.kv_rope_bf16 = True
    [fp8] = run_paged(model, [prompt], schedule, kv_dtype=FP8_DTYPE)
    # Wide random weights make attention peaky (see test_model_deepseek's whole-entry FP8 bound).
    assert (fp8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.3
    assert not torch.equal(fp8, exact)


def test_handoff_in_the_rope_bf16_layout_matches_one_engine(checkpoint):
    first = SamplingParams(temperature=0.0, max_tokens=1)
    rest = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens - 1, ignore_eos=True)
    prefill, single = engine(checkpoint.path, True), engine(checkpoint.path, True)
    decode, whole_entry = engine(checkpoint.path, True), engine(checkpoint.path, False)
    prompt = random_tokens(17, seed=5)
    events = []
    prefill.add_request(prompt, first, export_kv="fp8_e4m3", on_event=events.append)
    while prefill.has_unfinished():
        prefill.step()
    block = events[-1].kv
    assert block.bf16_tail == ROPE and tuple(block.k.shape[2:]) == (1, RANK + 2 * ROPE)
    expected = single.generate([prompt], GREEDY)[0].token_ids
    for receiver in (decode, whole_entry):  # the same layout bit for bit; the other one converted
        out = []
        receiver.add_request(prompt + events[-1].token_ids, rest, kv_import=block, on_event=out.append)
        while receiver.has_unfinished():
            receiver.step()
        tokens = events[-1].token_ids + [t for e in out for t in e.token_ids]
        assert len(tokens) == GREEDY.max_tokens
        if receiver is decode:
            assert tokens == expected
    converted = transfer.for_cache(block, whole_entry.cache)
    assert converted.bf16_tail == 0 and converted.k.shape[-1] == RANK + ROPE

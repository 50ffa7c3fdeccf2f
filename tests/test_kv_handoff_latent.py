"""The prefill -> decode hand-off of an MLA model sends its latent entry once: the cache's V is its K, so
the block carries one tensor (and, in FP8, one scale per layer and page), and the decode engine that
imports it continues exactly as one engine would."""

from __future__ import annotations

import pytest
import torch

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.kv import transfer
from gpu_workers.pools.handoff import deserialize, serialize
from gpu_workers.protocol import KVHandoff
from tests.hf_models import PAGE_SIZE, random_tokens, save_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LAYERS, ENTRY = 3, 16 + 8  # the tiny deepseek_v3 checkpoint: 3 layers of a 16 + 8 latent entry


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))


def make_engine(path, kv: str) -> Engine:
    config = EngineConfig(dtype="float32", kv_cache_dtype=kv, kv_budget_bytes=2**20, page_size=PAGE_SIZE)
    return Engine.from_pretrained(path, config)


def header(block: transfer.KVBlock, request_id: str) -> KVHandoff:
    layers, _, heads, head_dim = block.k.shape
    return KVHandoff(request_id, block.kv_format, block.num_tokens, layers, heads, head_dim, 0, 0)


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_latent_entry_goes_over_the_wire_once_and_decode_matches_one_engine(checkpoint, kv):
    prefill, decode, single = (make_engine(checkpoint.path, kv) for _ in range(3))
    prompt = random_tokens(19, seed=7)
    events = []
    prefill.add_request(
        prompt, SamplingParams(temperature=0.0, max_tokens=1), export_kv=kv, on_event=events.append
    )
    while prefill.has_unfinished():
        prefill.step()
    block = events[-1].kv
    assert block.v is None and block.v_scale is None
    element = 1 if kv == "fp8_e4m3" else 2
    entry_bytes = LAYERS * len(prompt) * ENTRY * element  # one latent tensor, no copy of it as V
    scale_bytes = LAYERS * -(-len(prompt) // PAGE_SIZE) * 4 if kv == "fp8_e4m3" else 0
    assert block.nbytes == entry_bytes + scale_bytes
    blob = serialize(header(block, "r1"), block)
    # safetensors adds a JSON header (names, shapes, the KVHandoff): well under one more copy of the entry.
    assert entry_bytes + scale_bytes < len(blob) < entry_bytes + scale_bytes + 1024 < 2 * entry_bytes
    _, received = deserialize(blob)
    assert received.v is None and torch.equal(received.k, block.k)

    out = []
    rest = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens - 1, ignore_eos=True)
    decode.add_request(prompt + events[-1].token_ids, rest, kv_import=received, on_event=out.append)
    while decode.has_unfinished():
        decode.step()
    tokens = events[-1].token_ids + [t for e in out for t in e.token_ids]
    assert tokens == single.generate([prompt], GREEDY)[0].token_ids


def test_a_block_with_a_duplicate_v_still_imports_and_a_v_less_block_needs_a_latent_cache(
    checkpoint, tmp_path
):
    latent = make_engine(checkpoint.path, "fp8_e4m3")
    events = []
    latent.add_request(random_tokens(9, seed=2), SamplingParams(temperature=0.0, max_tokens=1),
                       export_kv="fp8_e4m3", on_event=events.append)  # fmt: skip
    while latent.has_unfinished():
        latent.step()
    block = events[-1].kv
    twice = transfer.KVBlock(block.kv_format, block.num_tokens, block.k, block.k.clone(), block.k_scale,
                             block.k_scale.clone(), block.page_size)  # fmt: skip
    assert transfer.for_cache(twice, latent.cache).v is None  # what an older sender sent imports as one
    llama = make_engine(save_tiny("llama", tmp_path / "llama").path, "fp8_e4m3")
    with pytest.raises(transfer.InvalidKVBlock, match="no V"):
        transfer.check(block, llama.cache.spec)

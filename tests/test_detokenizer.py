"""Incremental detokenisation against a real byte-level BPE, where multi-byte characters span tokens."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gpu_workers.engine.detokenizer import IncrementalDetokenizer

TEXT = "Le café coûte 3€ — 漢字 and emoji 🙂👍🏽 done.\nSecond line: naïve 漢 end"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    # A small vocabulary trained on mostly-ASCII text: "é" gets merged, "漢", "€" and emoji stay split in bytes.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|eos|>"],
        show_progress=False,
    )
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog. café résumé naïve 漢"] * 20, trainer
    )
    return tok


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    chunks, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        chunks.append(detok.push(ids[i : i + n]))
        i += n
    chunks.append(detok.finish())
    return chunks


def test_fixture_really_splits_characters_across_tokens(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_token_by_token_stream_equals_full_decode_and_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    chunks = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(chunks) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("seed", range(5))
def test_random_chunk_sizes_give_the_same_text(tokenizer, seed):
    ids = tokenizer.encode(TEXT).ids
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tokenizer)
    chunks = stream(detok, ids, [rng.randint(1, 4) for _ in ids])
    assert "".join(chunks) == detok.text == TEXT
    assert not any("\ufffd" in c for c in chunks)


def test_special_tokens_are_skipped_by_default_and_kept_on_request(tokenizer):
    ids = tokenizer.encode("a 漢").ids + [tokenizer.token_to_id("<|eos|>")]
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == "a 漢"
    kept = "".join(stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids))
    assert kept == "a 漢<|eos|>"


def test_stop_string_truncates_text_before_it(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["漢字"])
    chunks = stream(detok, ids)
    assert "".join(chunks) == detok.text == "Le café coûte 3€ — "
    assert detok.stopped and detok.stop_string == "漢字"


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["brown cow"])
    assert detok.push(tokenizer.encode("the brown").ids) == "the "
    assert detok.push(tokenizer.encode(" c").ids) == ""
    # "brown fox" cannot become "brown cow": the held text is released as soon as that is certain.
    assert detok.push(tokenizer.encode("ox").ids) == "brown cox"
    assert not detok.stopped


def test_finish_flushes_a_partial_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["\n\n"])
    assert detok.push(tokenizer.encode("done\n").ids) == "done"
    assert detok.finish() == "\n"
    assert detok.text == "done\n" and not detok.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["lazy", "fox"])
    stream(detok, tokenizer.encode("the quick brown fox jumps over the lazy dog").ids)
    assert detok.text == "the quick brown " and detok.stop_string == "fox"


def test_stop_at_the_very_start_yields_empty_text_and_ignores_later_tokens(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["the"])
    assert detok.push(tokenizer.encode("the quick").ids) == ""
    assert detok.stopped
    assert detok.push(tokenizer.encode(" more").ids) == "" and detok.finish() == ""
    assert detok.text == ""


def test_prompt_context_is_not_emitted(tokenizer):
    prompt = tokenizer.encode("the quick 漢").ids
    out = tokenizer.encode(" brown fox").ids
    assert "".join(stream(IncrementalDetokenizer(tokenizer, prompt_ids=prompt), out)) == " brown fox"


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, stop=[""])


def test_a_character_split_between_prompt_and_output_appears_once_in_the_output(tokenizer):
    ids = tokenizer.encode("the 🙂 end").ids
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:cut])
    chunks = stream(detok, ids[cut:])
    # Neither the prompt's text nor a lost character: the emoji its last bytes complete, then the rest.
    assert "".join(chunks) == detok.text == "🙂 end"


def test_a_generation_cut_inside_a_character_ends_as_a_full_decode_does(tokenizer):
    ids = tokenizer.encode("ok 🙂").ids[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push([i]) for i in ids) == "ok "
    assert detok.finish() == "\ufffd" and detok.text == tokenizer.decode(ids)


def test_accepts_the_engines_tokenizer_wrapper(tokenizer):
    from gpu_workers.tokenizer import Tokenizer

    ids = tokenizer.encode(TEXT).ids
    assert "".join(stream(IncrementalDetokenizer(Tokenizer(tokenizer)), ids)) == TEXT

"""`tessera eval completions`: the fixed heads, the two-whole-lines parse rule, the repeated 4-gram share,
and the side-by-side command."""

from __future__ import annotations

import json
import shutil

import pytest
from tessera.cli import main

from gpu_workers.tools.eval.completions import (
    HEADS,
    lines_parsed,
    parses,
    repeated_ngrams,
    summarize_completions,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_heads_are_twenty_fixed_varied_prompts_that_end_before_the_newline():
    assert len(HEADS) == len(set(HEADS)) == 20
    for head in HEADS:
        assert head == head.rstrip(), head  # no trailing newline or space (TRAINING.md's tokenizer note)
        assert parses(head), head  # valid Python once its block is closed
    joined = "\n".join(HEADS)
    for kind in ("\nclass ", "    def ", "@", "->", '"""', "async def", ": int", "with "):
        assert kind in "\n" + joined, kind


def test_a_correct_two_line_body_counts():
    assert lines_parsed("def f(x):", "\n    y = x + 1\n    return y\n") == 2
    head = 'def f(x):\n    """Double x."""'
    assert lines_parsed(head, "\n    y = 2 * x\n\n    return y\nprint(") == 2  # the cut line is not counted
    # An open block closes with pass; a bracket opened on one line may close on the next.
    assert lines_parsed("def f(items):", "\n    for item in items:\n        if item:\n") == 2
    assert lines_parsed("def f(a):", "\n    return g(a,\n             1)\n") == 2
    # Garbage after two good lines does not undo them.
    assert lines_parsed("def f(x):", "\n    y = x\n    return y\n    ) = (\n") == 2


def test_garbage_and_one_line_bodies_do_not_count():
    assert lines_parsed("def f(x):", "\n    return (]\n    x = = 2\n") == 0
    assert lines_parsed("def f(x):", "\n    return x\n") == 1
    assert lines_parsed("def f(x):", "\n    return x\n    y = 2") == 1  # no newline after it: maybe cut off
    assert (
        lines_parsed("def f(x):", "\n    # a comment\n\n    #\n    return x\n") == 1
    )  # comments are not code
    assert lines_parsed("def f(x):", "\nreturn x\nreturn x\n") == 0  # the head's block has no body
    # The compiler's checks count, not only the grammar: duplicate arguments are not Python.
    assert lines_parsed("class A:", "\n    x = 1\n    def g(self, a, a):\n        pass\n") == 1
    assert lines_parsed("def f(x):", "") == 0


def test_repeated_4gram_share_on_crafted_tokens():
    assert repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4]) == (1, 5)  # 1234 twice; 2341, 3412, 4123 once
    assert repeated_ngrams([7] * 10) == (6, 7)
    assert repeated_ngrams(list(range(10))) == (0, 7)
    assert repeated_ngrams([1, 2, 3, 4, 5] * 3) == (7, 12)  # 5 distinct of 12
    assert repeated_ngrams([1, 2, 3]) == (0, 0)
    # Pooled over completions: (1 + 6) repeats of (5 + 7) 4-grams, not the mean of 0.2 and 6/7.
    rows = [
        {"repeated_4grams": r, "4grams": n, "parses": p, "tokens": t, "finish_reason": f}
        for r, n, p, t, f in ((1, 5, True, 8, "length"), (6, 7, False, 10, "stop"))
    ]
    summary = summarize_completions(rows)
    assert summary["repeated_4gram_share"] == 7 / 12
    assert summary["parse_share"] == 0.5 and summary["tokens_mean"] == 9 and summary["ended_by_eos"] == 1


def test_command_puts_models_side_by_side(demo_model_dir, tmp_path, capsys):
    copy = shutil.copytree(demo_model_dir, tmp_path / "copy")
    args = ["eval", "completions", "--model", str(demo_model_dir), "--model", str(copy), "--max-tokens", "8"]
    assert main([*args, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    first, second = (results["models"][str(d)] for d in (demo_model_dir, copy))
    assert results["max_tokens"] == 8 and first["heads"] == 20
    assert [c["head"] for c in first["completions"]] == list(HEADS)
    # Greedy: the same weights give the same completions, so the same numbers.
    assert first == second
    for c in first["completions"]:
        assert c["tokens"] <= 8
        assert c["lines_parsed"] == lines_parsed(c["head"], c["completion"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"| | {demo_model_dir} | {copy} |" in out
    assert "| parses (≥ 2 code lines) |" in out and "| repeated 4-grams |" in out
    assert "| 1. `def fibonacci(n):` |" in out and "| 20. `@dataclass class Item:` |" in out


def test_the_repetition_guard_changes_looping_completions_and_bad_values_are_refused(demo_model_dir, capsys):
    args = ["eval", "completions", "--model", str(demo_model_dir), "--max-tokens", "24", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)["models"][str(demo_model_dir)]
    assert main([*args, "--frequency-penalty", "2"]) == 0
    guarded = json.loads(capsys.readouterr().out)
    assert guarded["frequency_penalty"] == 2.0
    guarded = guarded["models"][str(demo_model_dir)]
    # The random demo model loops under plain greedy; a strong guard leaves fewer repeated 4-grams.
    assert guarded["repeated_4gram_share"] < plain["repeated_4gram_share"]
    assert main([*args, "--frequency-penalty", "3"]) != 0
    assert "--frequency-penalty must be in [-2, 2]" in capsys.readouterr().err

"""``tessera eval completions``: greedy completions of 20 fixed function and class heads, per model.

Each head (``HEADS``) ends before the newline, as a prompt for this tokenizer should (a newline is merged
with the next line's indentation). Every model completes every head greedily (temperature 0) through the
serving Engine in float32, up to ``max_tokens`` tokens or its end-of-file token.

**Parses (two whole lines)**: the code lines of a completion are the lines after the head's last line that
end in a newline (the last, unterminated piece may be cut off by the token limit and is never counted) and
hold code: not blank, not only a comment. For k = 1, 2, ..., the prefix is the head plus the completion up
to the end of its k-th code line; it parses when Python compiles it (``compile``: ``ast.parse`` plus the
compiler's own checks, so ``def f(a, a):`` or a ``return`` outside a function fail too) as is, or, when its
last line opens a block (ends with ``:``), with a ``pass`` line one level deeper appended. ``lines_parsed``
is the largest k whose prefix parses (0 if none); a completion counts when it is at least 2. Any k, not only
the last: a later line cut by the token limit, or garbage after two good lines, does not undo them; and a
bracket or string opened in line 2 may close in line 3. A line that leaves the head's block (the next
``def``) still counts as Python; one that breaks it (a column-0 line right after ``def f(x):``) does not.

**Repeated 4-grams**: over a completion's generated tokens (its end-of-file token excluded), the 4-gram
occurrences beyond the first of each distinct 4-gram; the share pools all completions: sum of repeated
occurrences / sum of 4-grams. A 4-gram shared by two different completions is not a repeat.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from gpu_workers.engine import Engine, EngineConfig, SamplingParams

MAX_TOKENS = 128
NGRAM = 4

# Fixed: changing one changes every number measured with this eval. Varied: plain functions, typed
# signatures, docstring'd heads, async, a nested block, methods, classes, a decorated function and class.
HEADS: tuple[str, ...] = (
    "def fibonacci(n):",
    "def is_prime(n):",
    "def main(argv=None):",
    "def clamp(value: float, low: float, high: float) -> float:",
    "def parse_args(argv: list[str] | None = None) -> argparse.Namespace:",
    'def read_lines(path):\n    """Return the lines of the text file at path, without line endings."""',
    'def merge_dicts(a: dict, b: dict) -> dict:\n    """Return a new dict with the keys of both; b wins."""',
    'def flatten(items):\n    """Yield the elements of nested lists, depth first."""',
    "async def fetch(session, url):",
    "def read_config(path):\n    with open(path) as f:",
    "class Stack:\n    def __init__(self):",
    "class Point:\n    def __init__(self, x, y):",
    'class Counter:\n    """Count how often each key was seen."""',
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:",
    "class ParseError(ValueError):",
    "class Node:\n    def __init__(self, value, next=None):\n        self.value = value\n"
    "        self.next = next\n\n    def __repr__(self):",
    "class Config:\n    @property\n    def name(self):",
    'class Version:\n    @classmethod\n    def from_string(cls, text: str) -> "Version":',
    "import functools\n\n\n@functools.lru_cache(maxsize=None)\ndef factorial(n: int) -> int:",
    "from dataclasses import dataclass\n\n\n@dataclass\nclass Item:",
)


def parses(source: str) -> bool:
    """Python compiles ``source``, as is or with an open block closed by ``pass``."""
    candidates = [source]
    last = source.rstrip("\n").rsplit("\n", 1)[-1]
    if last.rstrip().endswith(":"):
        indent = last[: len(last) - len(last.lstrip())]
        candidates.append(f"{source.rstrip()}\n{indent}    pass\n")
    for candidate in candidates:
        try:
            with warnings.catch_warnings():  # invalid escapes and the like warn; they still compile
                warnings.simplefilter("ignore")
                compile(candidate, "<completion>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            continue
        return True
    return False


def lines_parsed(head: str, completion: str) -> int:
    """The largest k such that the head plus the completion's first k code lines parses (0: none does)."""
    lines = (head + completion).split("\n")
    head_lines = head.count("\n") + 1
    best = k = 0
    for end in range(head_lines, len(lines) - 1):  # lines[-1] has no newline after it: never counted
        stripped = lines[end].strip()
        if not stripped or stripped.startswith("#"):
            continue
        k += 1
        if parses("\n".join(lines[: end + 1]) + "\n"):
            best = k
    return best


def repeated_ngrams(tokens: Sequence[int], n: int = NGRAM) -> tuple[int, int]:
    """(occurrences beyond the first of each distinct n-gram, n-grams) of one token list."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams)), len(grams)


def complete_heads(
    model_dir: Path,
    heads: Sequence[str] = HEADS,
    max_tokens: int = MAX_TOKENS,
    frequency_penalty: float = 0.0,
) -> list[dict]:
    """Each head's greedy completion under the model at ``model_dir`` and its measurements; with
    ``frequency_penalty``, greedy after the serving API's repetition guard (argmax of the penalised logits)."""
    engine = Engine.from_pretrained(model_dir, EngineConfig(dtype="float32", prefix_cache=False))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, frequency_penalty=frequency_penalty)
    results = []
    for head, out in zip(heads, engine.generate(list(heads), params), strict=True):
        tokens = [t for t in out.token_ids if t not in engine.eos_token_ids]
        repeated, ngrams = repeated_ngrams(tokens)
        k = lines_parsed(head, out.text)
        results.append(
            {
                "head": head,
                "completion": out.text,
                "tokens": len(tokens),
                "finish_reason": out.finish_reason,
                "lines_parsed": k,
                "parses": k >= 2,
                "repeated_4grams": repeated,
                "4grams": ngrams,
            }
        )
    return results


def summarize_completions(completions: list[dict]) -> dict:
    repeated = sum(c["repeated_4grams"] for c in completions)
    ngrams = sum(c["4grams"] for c in completions)
    passed = sum(c["parses"] for c in completions)
    return {
        "heads": len(completions),
        "parses": passed,
        "parse_share": passed / len(completions),
        "repeated_4gram_share": repeated / ngrams if ngrams else 0.0,
        "tokens_mean": sum(c["tokens"] for c in completions) / len(completions),
        "ended_by_eos": sum(c["finish_reason"] == "stop" for c in completions),
    }


def run_completions(
    model_dirs: Sequence[Path],
    max_tokens: int = MAX_TOKENS,
    log: Callable[[str], None] = lambda _: None,
    frequency_penalty: float = 0.0,
) -> dict:
    """Every model's completions of ``HEADS`` and their summary, keyed by the model's path as given."""
    models = {}
    for model_dir in model_dirs:
        completions = complete_heads(Path(model_dir), HEADS, max_tokens, frequency_penalty)
        models[str(model_dir)] = {**summarize_completions(completions), "completions": completions}
        log(f"{model_dir}: {models[str(model_dir)]['parses']}/{len(HEADS)} parse")
    return {"max_tokens": max_tokens, "frequency_penalty": frequency_penalty, "models": models}

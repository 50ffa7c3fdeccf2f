"""Example completions of a checkpoint through the serving Engine, printed as Markdown for TRAINING.md.

python -m gpu_workers.tools.train.examples models/pycode-tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpu_workers import Engine, EngineConfig, SamplingParams

# Prompts end before the newline: the tokenizer merges a newline with the next line's indentation
# ("\n    " is one token), so a prompt ending in a bare newline asks for a token training never showed
# before an indented line, and the model dedents.
PROMPTS = [
    "def fibonacci(n):",
    'import os\n\n\ndef list_python_files(directory):\n    """Return the paths of the .py files in directory."""',
    "class Stack:\n    def __init__(self):",
    "def",
]
CHAT = [
    {"role": "system", "content": "Read a JSON file."},
    {"role": "user", "content": "def read_json(path):"},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path, help="checkpoint folder")
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(args.model, EngineConfig(dtype="float32"))
    chat_prompt = engine.tokenizer.apply_chat_template(CHAT)
    cases = [(p, engine.tokenizer.encode(p), "completion") for p in PROMPTS]
    cases.append((chat_prompt, engine.tokenizer.encode(chat_prompt, add_special_tokens=False), "chat"))
    for text, ids, kind in cases:
        for name, params in (("greedy", GREEDY), ("sampled: temperature 0.8, top_p 0.95, seed 0", SAMPLED)):
            [out] = engine.generate([ids], params)
            shown = text.replace("<|bos|>", "")
            print(f"**{kind}, {name}** ({len(out.token_ids)} tokens, finish: {out.finish_reason})\n")
            print(f"```python\n{shown}\u2588{out.text}\n```\n")


if __name__ == "__main__":
    main()

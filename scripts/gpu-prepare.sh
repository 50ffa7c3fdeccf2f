#!/usr/bin/env bash
# What scripts/gpu-session.sh needs carried to the GPU machine, made here (where the package index is
# reachable), into two paths that git ignores and `run` carries:
#   .whl/                 wheels of what `tessera`'s command line imports and the GPU image lacks (its python3
#                         is 3.12 with torch, triton, safetensors, tokenizers, jinja2, rich, numpy, pytest), at
#                         this venv's versions; the session installs them with --no-index. .whl/interp: a
#                         NumPy below 2.4 for the interpreted kernel tests alone
#   .tessera/gpu-session/corpus.pt   with --corpus only (default-model work: the session trains only where it
#                         is carried): the trainer's tokenised corpus (--corpus-cache) with models/pycode-tiny's
#                         tokenizer, so the GPU machine (another Python, another stdlib) trains on this one
# Usage: bash scripts/gpu-prepare.sh [--no-wheels] [--corpus]
set -euo pipefail
cd "$(dirname "$0")/.."
cache=.tessera/gpu-session/corpus.pt
wheels=1 corpus=0
for arg in "$@"; do
    case $arg in
    --no-wheels) wheels=0 ;;
    --corpus) corpus=1 ;;
    *) echo "usage: bash scripts/gpu-prepare.sh [--no-wheels] [--corpus]" >&2; exit 2 ;;
    esac
done
if [ "$wheels" = 1 ]; then
    packages=(redis celery kombu amqp vine billiard tzlocal pydantic pydantic_core typing_inspection
        annotated_types typing_extensions)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    rm -rf .whl && mkdir .whl
    read -r -a pins < <(python - "${packages[@]}" <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{name}=={md.version(name)}" for name in sys.argv[1:]))
PY
)
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${pins[@]}"
    # Triton 3.6's interpreter (the GPU image's) converts 1-element arrays with int(), which NumPy 2.4
    # refuses: the session's interpreted kernel tests run with this NumPy instead, in their own path.
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl/interp "numpy>=2.0,<2.4"
    echo "wheels: $(ls .whl | wc -l) in .whl ($(du -sh .whl | cut -f1)), $(ls .whl/interp) in .whl/interp"
fi
rm -f "$cache"
[ "$corpus" = 1 ] || exit 0
# The flags that decide the corpus: the held-out split and the continued model's tokenizer.
python - "$cache" <<'PY'
import sys
from pathlib import Path

from gpu_workers.checkpoint import read_json
from gpu_workers.tools.train import pycode

config = read_json(Path("models/pycode-tiny/config.json"))
args = pycode.parse_args(
    ["--init-from", "models/pycode-tiny", "--vocab-size", str(config["vocab_size"]), "--corpus-cache", sys.argv[1]]
)
corpus, record = pycode.prepare_corpus(args)
print(
    f"corpus cache: {record['path']} ({len(corpus.train_stream)} train tokens, {len(corpus.heldout_files)} "
    f"held-out files, Python {corpus.python_version}), sha256 {record['sha256']}"
)
PY

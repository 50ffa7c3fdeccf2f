"""Train ``pycode-tiny``, the default model: a small Llama on the Python standard library's source.

    python -m gpu_workers.tools.train.pycode --out models/pycode-tiny

Reproducible from its arguments (recorded in ``training.json``) on any CPython of the same version, or
on any machine from a ``--corpus-cache`` file made on one (the tokenised corpus travels, not the stdlib).
``--device cuda`` trains on a GPU; batches are still drawn on the CPU, so a seed gives the same data there.
Each evaluation that improves the held-out loss rewrites the checkpoint folder, so a run stopped early
(``--max-minutes`` or a kill) still leaves a usable model; ``--resume`` continues from the work dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gpu_workers.model import load_model
from gpu_workers.tools.train.corpus_cache import TokenisedCorpus, file_sha256, load_corpus, save_corpus
from gpu_workers.tools.train.data import (
    SKIPPED_DIRS,
    eval_windows,
    is_dependency_file,
    stdlib_corpus,
    token_stream,
    train_tokenizer,
    unigram_perplexity,
    with_dependencies,
)
from gpu_workers.tools.train.docstrings import short_docstrings
from gpu_workers.tools.train.model import (
    build_model,
    hf_config,
    loss_fn,
    save_checkpoint,
    sequence_unlikelihood_loss,
)
from gpu_workers.tools.train.plot import plot_loss_curve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models/pycode-tiny"), help="checkpoint folder to write")
    p.add_argument("--work-dir", type=Path, default=Path(".tessera/train-pycode"), help="logs, resume state")
    p.add_argument("--resume", action="store_true", help="continue from --work-dir/state.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-percent", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--context", type=int, default=512, help="training sequence length = model context")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for matmuls (weights stay fp32)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model, its batches and the evaluations run (--bf16 autocasts on either)",
    )
    p.add_argument(
        "--corpus-cache",
        type=Path,
        default=None,
        metavar="FILE",
        help="the tokenised corpus (file lists, tokenizer, token streams): read from FILE if it exists, else "
        "built from this Python's stdlib and written there; training.json records its sha256",
    )
    p.add_argument(
        "--with-dependencies",
        action="store_true",
        help="train on the pure-Python sources of the project's permissively licensed dependencies too "
        "(train.data.DEPENDENCY_DISTRIBUTIONS, as installed here; each one's licence is recorded)",
    )
    p.add_argument(
        "--short-docstrings",
        action="store_true",
        help="cut every docstring of more than one paragraph to its first (train.docstrings), in the training "
        "and the held-out streams (`tessera eval lm` scores the files as they are)",
    )
    p.add_argument(
        "--unlikelihood",
        type=float,
        default=0.0,
        metavar="ALPHA",
        help="add ALPHA x the token-level unlikelihood loss (train.model.unlikelihood_loss) to training, "
        "against greedy decoding's loops; held-out loss stays plain cross-entropy",
    )
    p.add_argument(
        "--sequence-unlikelihood",
        type=float,
        default=0.0,
        metavar="P",
        help="add to each step, with probability P, --su-weight x the sequence-level unlikelihood loss "
        "(train.model.sequence_unlikelihood_loss: greedy continuations of the step's window prefixes, their "
        "repeated 4-grams made less likely)",
    )
    p.add_argument("--su-weight", type=float, default=1.0, help="weight of the sequence-level term")
    p.add_argument("--su-prefix", type=int, default=64, help="prefix tokens of a sequence-unlikelihood step")
    p.add_argument("--su-length", type=int, default=96, help="continuation tokens it generates and scores")
    p.add_argument(
        "--checkpoint",
        choices=("best", "last"),
        default="best",
        help="write the output folder at every evaluation that lowers held-out loss (best), or at every "
        "evaluation (last: for an objective besides held-out loss, such as --unlikelihood)",
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this wall time")
    p.add_argument(
        "--pause-at-step",
        type=int,
        default=None,
        metavar="N",
        help="stop after step N, leaving --work-dir's state for --resume (with other flags, for a run in "
        "phases); N a multiple of --eval-every, where the state is written",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue a trained model folder (its weights and tokenizer; the context may grow)",
    )
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument(
        "--short-context",
        type=int,
        default=None,
        help="train on windows of this length (same tokens per step) until --long-from of the run",
    )
    p.add_argument(
        "--long-from",
        type=float,
        default=0.5,
        help="fraction of the run after which windows are --context long",
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help="warmup-stable-decay schedule sized to this much training time: the learning rate stays at its "
        "peak until --decay-fraction of the budget is left, then decays linearly to lr * min-lr-ratio over the "
        "steps the measured step rate fits in what is left (the steps it chose are recorded, so --steps and "
        "--decay-start reproduce the run without a clock)",
    )
    p.add_argument("--decay-fraction", type=float, default=0.25)
    p.add_argument(
        "--decay-start", type=int, default=None, help="step-based warmup-stable-decay: decay from here"
    )
    return p.parse_args(argv)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``lr``; then cosine decay to ``lr * min_lr_ratio`` at the last step, or, with
    ``decay_start`` set, the peak until it and a linear decay to the floor at the last step (WSD)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    floor = args.lr * args.min_lr_ratio
    if args.decay_start is not None or args.budget_minutes is not None:
        if args.decay_start is None or step < args.decay_start:
            return args.lr
        progress = (step - args.decay_start) / max(1, args.steps - args.decay_start)
        return args.lr + (floor - args.lr) * min(progress, 1.0)
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def random_batch(
    stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    rows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows, batch: int, bf16: bool = False) -> float:
    """Mean cross-entropy over every held-out target token (full windows batched, the tail alone), computed
    on the model's device."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    full = [w for w in windows if len(w[0]) == len(windows[0][0])]
    groups = [full[i : i + batch] for i in range(0, len(full), batch)] + [[w] for w in windows[len(full) :]]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for group in groups:
            inputs = torch.stack([w[0] for w in group]).to(device)
            targets = torch.stack([w[1] for w in group]).to(device)
            total += loss_fn(model, inputs, targets).item() * targets.numel()
            count += targets.numel()
    return total / count


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = _device(args.device)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    corpus, cache_record = prepare_corpus(args)
    tokenizer, train_stream = corpus.tokenizer, corpus.train_stream
    windows = eval_windows(corpus.heldout_stream, args.context)
    heldout_targets = torch.cat([w[1] for w in windows])
    unigram_ppl = unigram_perplexity(train_stream, heldout_targets, args.vocab_size)
    _say(
        f"corpus: {len(corpus.train_files)} train files ({len(train_stream)} tokens), "
        f"{len(corpus.heldout_files)} held-out files ({len(heldout_targets)} target tokens); unigram ppl "
        f"{unigram_ppl:.1f}; prep {time.time() - started:.0f}s"
        + (f"; from {cache_record['path']}" if cache_record and cache_record["loaded"] else "")
    )

    config = hf_config(
        args.vocab_size,
        args.hidden_size,
        args.intermediate_size,
        args.layers,
        args.heads,
        args.kv_heads,
        args.context,
        args.rope_theta,
    )
    model = build_model(config, args.seed)
    if args.init_from is not None:
        model.load_state_dict(load_file(args.init_from / "model.safetensors"), strict=True)
        _say(f"initialised from {args.init_from} (its weights in float32, context now {args.context})")
    model.to(device)  # initialised on the CPU, so a seed gives the same model on every device
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    history: dict = {
        "train": [],
        "heldout": [],
        "best_step": None,
        "best_loss": float("inf"),
        "step": 0,
        "long_from_step": None if args.short_context else 0,
        "decay_start": args.decay_start,
        "steps": args.steps,
    }
    train_seconds = 0.0
    state_file = args.work_dir / "state.pt"
    if args.resume and state_file.is_file():
        state = torch.load(state_file, weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        history, train_seconds = state["history"], state["train_seconds"]
        args.decay_start, args.steps = history["decay_start"], history["steps"]
        _say(f"resumed at step {history['step']}")
    if args.unlikelihood > 0:  # a resumed run may add it part way: the step it started at is on record
        history.setdefault("unlikelihood_from_step", history["step"])
    if args.sequence_unlikelihood > 0:
        history.setdefault("sequence_unlikelihood_from_step", history["step"])
    num_params = sum(p.numel() for p in model.parameters())
    length = f"{args.steps} steps" if args.budget_minutes is None else f"{args.budget_minutes} min"
    _say(f"model: {num_params / 1e6:.2f}M parameters; {length} of {args.batch_size}x{args.context}")
    if args.budget_minutes is not None:
        args.steps = history["steps"] = (
            max(args.steps, 10**9) if history["decay_start"] is None else args.steps
        )

    log = (args.work_dir / "log.jsonl").open("a")
    model.train()
    window_start, window_tokens = time.time(), 0
    recent: list[float] = []
    step = history["step"]
    while step < args.steps:
        if args.pause_at_step is not None and step >= args.pause_at_step:
            _say(f"pausing at step {step} (--pause-at-step): resume with --resume")
            log.close()
            return
        if args.max_minutes is not None and train_seconds > args.max_minutes * 60:
            _say(f"stopping at step {step}: --max-minutes {args.max_minutes} reached")
            break
        step_start = time.time()
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if history["long_from_step"] is None and _past(args.long_from, step, train_seconds, args):
            history["long_from_step"] = step
            _say(f"step {step}: windows are now {args.context} tokens")
        if history["long_from_step"] is None:  # the same tokens per step in shorter windows
            rows = args.batch_size * args.context // args.short_context
            inputs, targets = random_batch(train_stream, rows, args.short_context, gen)
        else:
            inputs, targets = random_batch(train_stream, args.batch_size, args.context, gen)
        inputs, targets = inputs.to(device), targets.to(device)
        sequence_step = (
            args.sequence_unlikelihood > 0 and torch.rand((), generator=gen) < args.sequence_unlikelihood
        )
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = loss_fn(model, inputs, targets, args.unlikelihood)
            if sequence_step:  # the prefixes: the first tokens of this step's windows
                extra, repeats = sequence_unlikelihood_loss(
                    model, inputs[:, : args.su_prefix], args.su_length
                )
                loss = loss + args.su_weight * extra
                history["sequence_steps"] = history.get("sequence_steps", 0) + 1
                history.setdefault("sequence_repeats", []).append((step + 1, round(repeats, 4)))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's time is its GPU time: the budget and tokens/s count it
        train_seconds += time.time() - step_start
        window_tokens += inputs.numel()
        history["step"] = step + 1
        recent.append(time.time() - step_start)
        if args.budget_minutes is not None and history["decay_start"] is None:
            left = args.budget_minutes * 60 - train_seconds
            if left <= args.decay_fraction * args.budget_minutes * 60:
                per_step = sum(recent[-20:]) / len(recent[-20:])
                args.decay_start = history["decay_start"] = step + 1
                args.steps = history["steps"] = step + 1 + max(1, int(left / per_step))
                _say(f"step {step + 1}: decaying the learning rate over {args.steps - step - 1} steps")
        if (step + 1) % args.log_every == 0 or step == 0:
            tokens_per_s = window_tokens / (time.time() - window_start)
            window_start, window_tokens = time.time(), 0
            history["train"].append((step + 1, loss.item()))
            entry = {
                "step": step + 1,
                "loss": round(loss.item(), 4),
                "lr": lr,
                "grad_norm": round(grad_norm.item(), 3),
                "tokens_per_s": round(tokens_per_s),
                "train_seconds": round(train_seconds),
            }
            log.write(json.dumps(entry) + "\n")
            log.flush()
            _say(json.dumps(entry))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            _evaluate(model, windows, args, history, config, tokenizer, log)
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "generator": gen.get_state(),
                    "history": history,
                    "train_seconds": train_seconds,
                },
                state_file,
            )
            _write_report(
                args, corpus, cache_record, history, num_params, train_seconds, unigram_ppl, windows
            )
            window_start, window_tokens = time.time(), 0  # evaluation time is not training time
        step += 1

    if history["best_step"] is None or history["heldout"][-1][0] != history["step"]:
        _evaluate(model, windows, args, history, config, tokenizer, log)
    # The number that ships: the saved bf16 weights, read back through the serving loader.
    shipped = load_model(args.out, dtype=torch.float32, device=device)
    final_loss = heldout_loss(shipped, windows, args.batch_size)
    _write_report(
        args, corpus, cache_record, history, num_params, train_seconds, unigram_ppl, windows, final_loss
    )
    _say(
        f"done: best step {history['best_step']}, held-out ppl {math.exp(final_loss):.2f} "
        f"(unigram {unigram_ppl:.1f}), {train_seconds / 60:.1f} min training"
    )


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device; use --device cpu")
    return torch.device(name)


def prepare_corpus(args: argparse.Namespace) -> tuple[TokenisedCorpus, dict | None]:
    """The tokenised corpus, from ``--corpus-cache`` when that file exists (checked against the flags and
    ``--init-from``'s tokenizer), else from this Python's stdlib (written to the cache if one is named).
    Also what training.json records of the cache: its path, sha256 and whether it was read."""
    init_tokenizer = None
    if args.init_from is not None:  # the same tokenizer, so the trained embeddings keep their meaning
        init_tokenizer = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
        if init_tokenizer.get_vocab_size() != args.vocab_size:
            raise SystemExit(
                f"--vocab-size {args.vocab_size} != {args.init_from}'s {init_tokenizer.get_vocab_size()}"
            )
    cache = args.corpus_cache
    if cache is not None and cache.is_file():
        try:
            corpus = load_corpus(cache)
        except ValueError as exc:
            raise SystemExit(f"--corpus-cache: {exc}") from None
        if bool(corpus.sources) != args.with_dependencies:
            made = "with" if corpus.sources else "without"
            raise SystemExit(
                f"--corpus-cache {cache} was made {made} --with-dependencies: pass the same, or another cache file"
            )
        if corpus.short_docstrings != args.short_docstrings:
            made = "with" if corpus.short_docstrings else "without"
            raise SystemExit(
                f"--corpus-cache {cache} was made {made} --short-docstrings: pass the same, or another cache file"
            )
        if corpus.heldout_percent != args.heldout_percent:
            raise SystemExit(
                f"--corpus-cache {cache} holds a {corpus.heldout_percent}% held-out split, not "
                f"--heldout-percent {args.heldout_percent}: pass that, or another cache file"
            )
        if corpus.tokenizer.get_vocab_size() != args.vocab_size:
            raise SystemExit(
                f"--corpus-cache {cache} was tokenised with a {corpus.tokenizer.get_vocab_size()}-token "
                f"vocabulary, not --vocab-size {args.vocab_size}"
            )
        if init_tokenizer is not None and init_tokenizer.to_str() != corpus.tokenizer.to_str():
            raise SystemExit(
                f"--corpus-cache {cache} was tokenised with another tokenizer than {args.init_from}'s: "
                "make the cache with the same --init-from"
            )
        return corpus, {"path": str(cache), "sha256": file_sha256(cache), "loaded": True}
    files = stdlib_corpus(heldout_percent=args.heldout_percent)
    if args.with_dependencies:
        try:
            files = with_dependencies(files, heldout_percent=args.heldout_percent)
        except ValueError as exc:
            raise SystemExit(f"--with-dependencies: {exc}") from None
    scored = [f for f in files.heldout if not is_dependency_file(f)]
    edit = short_docstrings if args.short_docstrings else (lambda text: text)
    train_texts = [edit(text) for text in files.texts(files.train)]
    tokenizer = init_tokenizer or train_tokenizer(train_texts, args.vocab_size)
    corpus = TokenisedCorpus(
        train_files=files.train,
        heldout_files=scored,
        heldout_percent=args.heldout_percent,
        tokenizer=tokenizer,
        train_stream=token_stream(tokenizer, train_texts),
        heldout_stream=token_stream(tokenizer, [edit(text) for text in files.texts(scored)]),
        sources=tuple(dataclasses.asdict(source) for source in files.sources),
        dependency_heldout_files=tuple(filter(is_dependency_file, files.heldout)),
        short_docstrings=args.short_docstrings,
    )
    if cache is None:
        return corpus, None
    return corpus, {"path": str(cache), "sha256": save_corpus(corpus, cache), "loaded": False}


def _past(fraction: float, step: int, train_seconds: float, args: argparse.Namespace) -> bool:
    """Whether ``fraction`` of the run is done: of the time budget, or else of the steps (a value ≥ 1 is a
    step number, which reproduces a budgeted run's recorded ``long_from_step`` exactly)."""
    if fraction >= 1:
        return step >= fraction
    if args.budget_minutes is not None:
        return train_seconds >= fraction * args.budget_minutes * 60
    return step >= fraction * args.steps


def _evaluate(model, windows, args, history, config, tokenizer, log) -> None:
    model.eval()
    loss = heldout_loss(model, windows, args.batch_size, args.bf16)
    model.train()
    history["heldout"].append((history["step"], loss))
    improved = loss < history["best_loss"]
    if improved:
        history["best_loss"], history["best_step"] = loss, history["step"]
    if improved or args.checkpoint == "last":
        save_checkpoint(model, config, tokenizer, args.out)
    entry = {"step": history["step"], "heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 3)}
    log.write(json.dumps(entry) + "\n")
    log.flush()
    written = (
        " (best: checkpoint written)"
        if improved
        else " (checkpoint written)"
        if args.checkpoint == "last"
        else ""
    )
    _say(json.dumps(entry) + written)


def _write_report(
    args, corpus, cache_record, history, num_params, train_seconds, unigram_ppl, windows, final_loss=None
) -> None:
    """training.json and loss_curve.png next to the checkpoint; rewritten at every evaluation."""
    steps_done = history["step"]
    hyper = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record = {
        "status": "complete" if final_loss is not None else f"in progress (step {steps_done})",
        "command": "python -m gpu_workers.tools.train.pycode " + " ".join(_cli_args(args)),
        "corpus": {
            "source": "CPython standard library .py files (sysconfig.get_paths()['stdlib'])"
            + (", and the dependencies' .py files below (site-packages/...)" if corpus.sources else ""),
            "python_version": corpus.python_version,
            "dependencies": list(corpus.sources),
            "cache": cache_record,
            "skipped_dirs": sorted(SKIPPED_DIRS),
            "skipped_files": "generated charmap codec tables (files containing 'decoding_table = (')",
            "heldout_rule": f"sha256(relative path)[:8] as int % 100 < {args.heldout_percent}",
            "train_files": len(corpus.train_files),
            "train_tokens": len(corpus.train_stream),
            "heldout_target_tokens": sum(len(w[1]) for w in windows),
            "heldout_files": corpus.heldout_files,
            "dependency_heldout_files": list(corpus.dependency_heldout_files),
            "short_docstrings": corpus.short_docstrings,
        },
        "seed": args.seed,
        "initialised_from": _init_record(args.init_from),
        "long_from_step": history["long_from_step"],
        "unlikelihood_from_step": history.get("unlikelihood_from_step"),
        "sequence_unlikelihood_from_step": history.get("sequence_unlikelihood_from_step"),
        "sequence_unlikelihood_steps": history.get("sequence_steps", 0),
        "sequence_repeat_share": history.get("sequence_repeats", []),
        "decay_start": history["decay_start"],
        "hyperparameters": hyper,
        "parameters": num_params,
        "steps_done": steps_done,
        "tokens_seen": steps_done * args.batch_size * args.context,
        "train_seconds": round(train_seconds),
        "tokens_per_s": round(steps_done * args.batch_size * args.context / max(train_seconds, 1e-9)),
        "best_step": history["best_step"],
        "best_heldout_loss_during_training": history["best_loss"],
        "unigram_perplexity": unigram_ppl,
        "heldout_perplexity": None if final_loss is None else math.exp(final_loss),
        "heldout_loss": final_loss,
        "heldout_curve": history["heldout"],
        "train_curve": history["train"],
        "machine": {
            "torch": torch.__version__,
            "threads": args.threads,
            "python": sys.version.split()[0],
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if history["train"]:
        title = f"pycode-tiny: {num_params / 1e6:.1f}M params, {steps_done} steps"
        plot_loss_curve(
            history["train"], history["heldout"], math.log(unigram_ppl), args.out / "loss_curve.png", title
        )


def _init_record(folder: Path | None) -> dict | None:
    """What the continued model had already seen (its own training.json), so the total compute is on record."""
    if folder is None:
        return None
    record = folder / "training.json"
    earlier = json.loads(record.read_text()) if record.is_file() else {}
    return {key: earlier.get(key) for key in ("command", "tokens_seen", "train_seconds", "heldout_loss")} | {
        "path": str(folder)
    }


def _cli_args(args: argparse.Namespace) -> list[str]:
    defaults = vars(parse_args([]))
    out = []
    for key, value in vars(args).items():
        if key in ("resume", "work_dir") or value == defaults[key]:
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def _say(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, flush=True)


if __name__ == "__main__":
    main()

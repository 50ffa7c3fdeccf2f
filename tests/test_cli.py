"""The ``tessera`` command line, run as a user runs it: a subprocess, checked by exit code, stdout and stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tessera(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # The source roots go on PYTHONPATH so the tests also run from a checkout that is not pip-installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "tessera.cli", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def json_lines(stdout: str) -> list[dict]:
    """Every stdout line must be one JSON object: progress bars and notes belong on stderr."""
    return [json.loads(line) for line in stdout.splitlines()]


@pytest.fixture(scope="module")
def no_tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("no-tokenizer")
    result = tessera("init-model", path, "--no-tokenizer", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert "gibberish" in result.stdout
    return path


def test_cli_module_imports_without_torch():
    code = "import sys, tessera.cli; tessera.cli.build_parser(); assert 'torch' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_entry_point_is_installed():
    result = subprocess.run(
        [Path(sys.executable).parent / "tessera", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert all(cmd in result.stdout for cmd in ("init-model", "generate", "bench"))


def test_generate_json_with_prompt_ids_prints_one_object_per_prompt(demo_model_dir):
    result = tessera(
        "generate", "--model", demo_model_dir, "--prompt-ids", "5,6,7", "--prompt-ids", "8,9",
        "--max-tokens", "5", "--temperature", "0", "--json", "--dtype", "float32",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outputs = json_lines(result.stdout)
    assert [o["prompt_tokens"] for o in outputs] == [3, 2]
    for out in outputs:
        assert set(out) >= {"token_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens", "error"}
        assert out["finish_reason"] in ("length", "stop") and 1 <= len(out["token_ids"]) <= 5
        assert isinstance(out["text"], str) and out["error"] is None


def test_same_seed_gives_same_text_across_runs(demo_model_dir):
    args = (
        "generate",
        "--model",
        demo_model_dir,
        "--prompt",
        "def fib(n):",
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
    )
    first, second = (json_lines(tessera(*args, "--seed", "7", "--json").stdout)[0] for _ in range(2))
    assert first["token_ids"] == second["token_ids"] and first["text"] == second["text"]


def test_streamed_text_equals_generated_text(demo_model_dir):
    args = (
        "generate",
        "--model",
        demo_model_dir,
        "--prompt",
        "class Foo:",
        "--max-tokens",
        "12",
        "--seed",
        "3",
    )
    generated = json_lines(tessera(*args, "--json").stdout)[0]["text"]
    streamed = tessera(*args)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == generated + "\n"


def test_stop_string_truncates_the_output(demo_model_dir):
    args = ("generate", "--model", demo_model_dir, "--prompt", "import os", "--max-tokens", "16")
    args += ("--temperature", "0", "--json", "--dtype", "float32")
    full = json_lines(tessera(*args).stdout)[0]["text"]
    stop = full[len(full) // 2 :][:3]
    assert stop, f"the greedy output {full!r} is too short to pick a stop string from"
    stopped = json_lines(tessera(*args, "--stop", stop).stdout)[0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == full[: full.index(stop)]


def test_checkpoint_without_tokenizer_generates_from_prompt_ids(no_tokenizer_dir):
    result = tessera(
        "generate", "--model", no_tokenizer_dir, "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"
    )
    assert result.returncode == 0, result.stderr
    (out,) = json_lines(result.stdout)
    assert out["text"] == "" and 1 <= len(out["token_ids"]) <= 4
    streamed = tessera("generate", "--model", no_tokenizer_dir, "--prompt-ids", "1,2,3", "--max-tokens", "4")
    assert streamed.returncode == 0, streamed.stderr
    assert all(tok.isdigit() for tok in streamed.stdout.split())


def test_text_prompt_without_tokenizer_is_a_usage_error(no_tokenizer_dir):
    result = tessera("generate", "--model", no_tokenizer_dir, "--prompt", "hello")
    assert result.returncode == 2
    assert "--prompt-ids" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--prompt-ids", "1,2", "--top-p", "1.5"], 2, "top_p"),
        (["--prompt-ids", "1,2", "--max-tokens", "0"], 2, "max_tokens"),
        (["--prompt-ids", "1,2", "--dtype", "int8"], 2, "dtype must be one of"),
        (["--prompt-ids", "1,x"], 2, "comma-separated integers"),
        (["--prompt-ids", "1,2", "--page-size", "3"], 2, "power of two"),
        (["--prompt-ids", "1,99999", "--json"], 2, "token ids must be integers"),
        # The demo checkpoint's context is 2048 tokens.
        (["--prompt-ids", "1,2", "--max-tokens", "100000"], 2, "context of 2048"),
        (["--prompt-ids", "1,2", "--max-tokens", "100000", "--json"], 2, "context of 2048"),
        (["--prompt-ids", "1,2", "--prompt-ids", "1,2,3,4", "--max-tokens", "2045"], 2, "prompt 1:"),
    ],
    ids=["top-p", "max-tokens-zero", "dtype", "ids-not-integers", "page-size", "id-out-of-vocab",
         "max-tokens-over-context", "max-tokens-over-context-json", "prompt-plus-max-tokens"],
)  # fmt: skip
def test_bad_arguments_exit_non_zero_with_a_message(demo_model_dir, args, code, message):
    result = tessera("generate", "--model", demo_model_dir, *args)
    assert result.returncode == code
    assert message in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    if code == 2:
        assert result.stdout.strip() == ""  # refused before generating anything


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["init-model", "{tmp}/m", "--arch", "gpt"], "unknown arch 'gpt'"),
        (["calibrate", "{model}", "--out", "{tmp}/s.json", "--dtype", "int8"], "--dtype must be one of"),
        (["calibrate", "{model}", "--out", "{tmp}/s.json", "--max-tokens", "0"], "--max-tokens"),
        (["eval", "quality", "--model", "{model}", "--max-files", "0"], "--max-files must be positive"),
        (["bench", "kernels", "--threads", "0"], "--threads needs a positive integer"),
        (["bench", "weights", "--model", "{model}", "--formats", "int3"], "--formats takes"),
        (
            ["worker", "--deployment", "d", "--pool", "serve", "--metrics-port", "70000"],
            "--metrics-port must",
        ),
        (
            [
                "bench",
                "serve",
                "--url",
                "u",
                "--model",
                "m",
                "--api-key",
                "k",
                "--concurrency",
                "1",
                "--shared-prefix-len",
                "300",
            ],
            "--shared-prefix-len must be between",
        ),
    ],
    ids=[
        "init-model-arch",
        "calibrate-dtype",
        "calibrate-max-tokens",
        "eval-max-files",
        "bench-threads",
        "bench-formats",
        "worker-metrics-port",
        "bench-serve-prefix",
    ],
)
def test_bad_arguments_of_other_commands_exit_2(demo_model_dir, tmp_path, args, message):
    result = tessera(*(a.format(tmp=tmp_path, model=demo_model_dir) for a in args))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "m").exists() and not (tmp_path / "s.json").exists()


def test_missing_model_folder_is_reported_without_traceback(tmp_path):
    result = tessera("generate", "--model", tmp_path / "nope", "--prompt-ids", "1,2")
    assert result.returncode == 1
    assert "nope" in result.stderr and "Traceback" not in result.stderr


def test_bench_engine_reports_both_systems_and_agrees_on_greedy_tokens(demo_model_dir):
    result = tessera(
        "bench", "engine", "--model", demo_model_dir,
        "--concurrency", "1,3", "--max-tokens", "4", "--repeat", "1", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    for row in report["results"]:
        assert row["engine_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
        assert row["greedy_match"] == row["concurrency"]
    # Every linear of a step is in the GEMM baseline, packed for oneDNN or not: 4 layers x (q/k/v, o,
    # gate/up, down) and the output projection. The share itself is two timings of separate runs (the
    # GEMMs replayed alone, the step): on a loaded machine it can exceed 1, so only its presence is checked.
    efficiency = report["decode_efficiency"]
    assert efficiency["linears"] == 17 and efficiency["gemm_share_of_step"] > 0

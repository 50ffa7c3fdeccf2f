#!/usr/bin/env bash
# One prepared GPU session (issue 14 item 5, issue 16 item 2), under 10 minutes on an H200:
#   env          nvidia-smi, python / torch / triton versions
#   kernel-check the Triton kernels compiled on CUDA vs their torch references, and an engine's greedy tokens
#                on the kernels vs on the references (scripts/gpu_kernel_check.py)
#   kernels      tessera bench kernels: W4A16 / FP8 GEMV vs BF16 at batch 1, 8, 32 on 4096x4096 and
#                4096x14336; paged decode attention GB/s vs the H200's 4,800 GB/s
#   int4-sweep   the W4A16 kernel's launch choice against a sweep of tile widths and K splits, BF16, and
#                (TESSERA_GPU_INT4_BASELINE=FILE, carried) another version of the kernel
#   train        only where the corpus cache is carried (default-model work): the trainer on cuda for a fixed
#                time budget, continuing models/pycode-tiny; the model is written under OUT_DIR
#   llama-1b     a random ~1B-parameter Llama written at run time, then `tessera quantize` to fp8 and int4
#   engine-*     tessera bench kv-formats: decode tok/s at 1/8/16/32/64 concurrent, BF16 vs FP8 KV, on the
#                bf16, fp8 and int4 checkpoints (one budget that preempts nothing)
#   engine-graphs the bf16 checkpoint's kv-formats run again with decode steps from CUDA graphs
#   engine-int4-fast the int4 checkpoint's run again on the fast W4A16 kernel (TESSERA_INT4_KERNEL=fast)
#   step-profile a decode step's wall time against its GPU kernel time and launches, bf16 1B model,
#                BF16 / FP8 KV at 1 and 64 concurrent, eager and from CUDA graphs (gpu_step_profile.py)
#   tests        TESSERA_KERNELS=triton pytest tests/test_kernels.py and tests/test_decode_launches.py (the
#                interpreter, on this Triton: kernels vs references, launches per decode layer held), run on
#                the CPUs alongside the GPU stages from the start, with the NumPy carried in .whl/interp
#                where there is one (Triton 3.6's interpreter fails on NumPy 2.4, seen on a CPU too)
# Each stage runs under its own timeout, capped by what is left of the whole script's deadline
# (TESSERA_GPU_DEADLINE_S, default 560 s), and writes OUT_DIR/<stage>.log (+ .json); OUT_DIR/summary.tsv
# holds stage, rc, seconds, budget. TESSERA_GPU_STAGES="a b ..." runs only the stages named (a rerun of
# what failed: llama-1b and quantize where an engine stage is named); TESSERA_GPU_ENGINE_REPS=N sets every
# engine stage's repetitions. `--smoke` shrinks every stage to run on a CPU in a few minutes.
# Needs first (here, not there): bash scripts/gpu-prepare.sh. Nothing is fetched from the network.
#
# Usage: bash scripts/gpu-session.sh OUT_DIR [--smoke]
set -uo pipefail

# All of it in one function, read whole before it runs: editing the file mid-session cannot derail it.
main() {
if [ $# -lt 1 ] || [ $# -gt 2 ] || { [ $# -eq 2 ] && [ "$2" != --smoke ]; }; then
    echo "usage: bash scripts/gpu-session.sh OUT_DIR [--smoke]" >&2
    return 2
fi
out=$(realpath -m "$1")
smoke=0
[ "${2:-}" = --smoke ] && smoke=1
root=$(cd "$(dirname "$0")/.." && pwd)
self=$root/scripts/$(basename "$0")
cd "$root" || return 2
scratch=${TESSERA_GPU_SCRATCH:-/tmp/tessera-gpu-session}  # the 1B checkpoints (GBs): never under OUT_DIR
cache=.tessera/gpu-session/corpus.pt
py=${PYTHON:-python3}
tessera=("$py" -m tessera.cli)

# -- what each stage runs, full size or --smoke ---------------------------------------------------------------
if [ "$smoke" = 1 ]; then
    device=cpu
    scale=3  # budgets: this CPU does in 3x the time what the GPU machine must do in 1x
    kernels_flags=(--device cpu --threads 1 --batch 1,8 --shape 256x512 --context 64 --attn-batch 1)
    check_flags=(--smoke)
    llama=(hidden_size=128 intermediate_size=256 num_hidden_layers=2 num_attention_heads=4 num_key_value_heads=2
        vocab_size=512)
    engine_flags=(--device cpu --dtype float32 --threads 1 --concurrency 1,4 --prompt-tokens 16 --max-tokens 4
        --kv-budget-bytes 8000000)
    engine_reps=(1 1)
    train_flags=(--device cpu --steps 3 --eval-every 3 --context 128 --batch-size 16 --warmup-steps 1)
    tests=(tests/test_kernels.py tests/test_decode_launches.py -k "kv_write_bf16 or fp8_gemm or launches")
    profile_flags=(--device cpu --concurrency 1,4 --steps 3 --kv bf16 --cuda-graphs both)
    sweep_flags=(--device cpu --shape 256x128 --batch 1)
else
    device=cuda
    scale=1
    kernels_flags=(--device cuda --batch 1,8,32 --peak-gbs 4800)
    check_flags=()
    # Llama-3.2-1B's decoder shapes (hidden 2048, MLP 8192, 16 layers, GQA 32/8 heads): 0.98B parameters in
    # the linear layers; a 2,048-token vocabulary (the demo tokenizer) instead of 128k.
    llama=(hidden_size=2048 intermediate_size=8192 num_hidden_layers=16 num_attention_heads=32 num_key_value_heads=8
        vocab_size=2048 max_position_embeddings=4096)
    engine_flags=(--device cuda --dtype bfloat16 --concurrency 1,8,16,32,64 --prompt-tokens 192 --max-tokens 64
        --kv-budget-bytes 8589934592)
    engine_reps=(2 1)  # bf16 weights (the KV comparison), then each quantised checkpoint
    if [ -n "${TESSERA_GPU_ENGINE_REPS:-}" ]; then engine_reps=("$TESSERA_GPU_ENGINE_REPS" "$TESSERA_GPU_ENGINE_REPS"); fi
    # bf16 autocast, 2 minutes of steps (warmup-stable-decay sized to it), 32 x 2,048-token windows per step.
    train_flags=(--device cuda --bf16 --budget-minutes 2 --context 2048 --batch-size 32 --lr 2e-3
        --warmup-steps 20 --eval-every 500 --log-every 50)
    tests=(tests/test_kernels.py tests/test_decode_launches.py tests/test_int4_fast_dequant.py
        tests/test_fp8_attention_fold.py -n 6)
    profile_flags=(--device cuda --concurrency 1,64 --steps 10 --cuda-graphs both)
    sweep_flags=()
fi

# -- the stages: functions, each run by this script again under `timeout` (GPU_SESSION_STAGE=name) ----------
stage_env() {
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "no nvidia-smi on this machine"; fi
    "$py" - "$out/env.json" <<'PY'
import json, os, platform, sys
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
cuda = torch.cuda.is_available()
env = {
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "triton": triton_version,
    "cuda_available": cuda,
    "device": torch.cuda.get_device_name() if cuda else None,
    "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
    "cpus": os.cpu_count(),
    "machine": platform.machine(),
}
print(json.dumps(env, indent=2))
open(sys.argv[1], "w").write(json.dumps(env, indent=2) + "\n")
PY
}

stage_kernel-check() {
    "$py" scripts/gpu_kernel_check.py --json "$out/kernel-check.json" "${check_flags[@]}"
}

stage_kernels() {
    "${tessera[@]}" bench kernels --json "${kernels_flags[@]}" >"$out/kernels.json"
}

stage_int4-sweep() {
    local baseline=()
    [ -n "${TESSERA_GPU_INT4_BASELINE:-}" ] && baseline=(--baseline "$TESSERA_GPU_INT4_BASELINE")
    if [ "$smoke" = 1 ]; then export TRITON_INTERPRET=1; fi
    "$py" scripts/gpu_int4_sweep.py --json "$out/int4-sweep.json" "${sweep_flags[@]}" "${baseline[@]}"
}

stage_train() {
    if [ ! -f "$cache" ]; then
        echo "no $cache: run scripts/gpu-prepare.sh here and carry .tessera/gpu-session" >&2
        return 2
    fi
    # The continued model's own shapes and RoPE base, so --init-from loads strictly whatever it is now.
    local shape
    shape=$("$py" -c '
import json
c = json.load(open("models/pycode-tiny/config.json"))
print(" ".join(map(str, [
    "--vocab-size", c["vocab_size"], "--hidden-size", c["hidden_size"],
    "--intermediate-size", c["intermediate_size"], "--layers", c["num_hidden_layers"],
    "--heads", c["num_attention_heads"], "--kv-heads", c["num_key_value_heads"],
    "--rope-theta", c["rope_theta"],
])))') || return 2
    # shellcheck disable=SC2086  # the shape is a list of flags
    "$py" -m gpu_workers.tools.train.pycode --init-from models/pycode-tiny --corpus-cache "$cache" \
        --out "$out/pycode-gpu" --work-dir "$scratch/train" $shape "${train_flags[@]}"
}

stage_llama-1b() {
    "$py" - "$scratch/llama" "${llama[@]}" <<'PY'
import sys, time
from gpu_workers.tools.demo_checkpoint import write_demo_checkpoint
shape = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
start = time.time()
write_demo_checkpoint(sys.argv[1], **shape)
print(f"wrote {sys.argv[1]} {shape} in {time.time() - start:.1f} s")
PY
}

stage_quantize() {
    "${tessera[@]}" quantize "$scratch/llama" "$scratch/llama-fp8" --weights fp8 &&
        "${tessera[@]}" quantize "$scratch/llama" "$scratch/llama-int4" --weights int4
}

engine() {  # engine CHECKPOINT REPS JSON [FLAG...]: decode tok/s per concurrency, BF16 vs FP8 KV
    "${tessera[@]}" bench kv-formats --model "$1" --reps "$2" --json "${engine_flags[@]}" "${@:4}" >"$3"
}
stage_engine-bf16-weights() { engine "$scratch/llama" "${engine_reps[0]}" "$out/engine-bf16-weights.json"; }
stage_engine-fp8-weights() { engine "$scratch/llama-fp8" "${engine_reps[1]}" "$out/engine-fp8-weights.json"; }
stage_engine-int4-weights() { engine "$scratch/llama-int4" "${engine_reps[1]}" "$out/engine-int4-weights.json"; }
stage_engine-int4-fast() {  # the same on the fast W4A16 kernel (TESSERA_INT4_KERNEL; the default is convert)
    TESSERA_INT4_KERNEL=fast engine "$scratch/llama-int4" "${engine_reps[1]}" "$out/engine-int4-fast.json"
}
stage_engine-graphs() { engine "$scratch/llama" "${engine_reps[1]}" "$out/engine-graphs.json" --cuda-graphs; }

stage_step-profile() {
    "$py" scripts/gpu_step_profile.py "$scratch/llama" --json "$out/step-profile.json" "${profile_flags[@]}"
}

stage_tests() {
    if [ "$smoke" = 0 ] && ls .whl/interp/*.whl >/dev/null 2>&1; then  # (cp312: the GPU image's Python)
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$scratch/site-interp" .whl/interp/*.whl || return 2
        export PYTHONPATH=$scratch/site-interp:$PYTHONPATH
    fi
    TESSERA_KERNELS=triton "$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
}

if [ -n "${GPU_SESSION_STAGE:-}" ]; then  # one stage, run by `stage` below
    "stage_$GPU_SESSION_STAGE"
    return $?
fi

# -- the session ------------------------------------------------------------------------------------------------
deadline=$((SECONDS + ${TESSERA_GPU_DEADLINE_S:-$((560 * scale))}))
mkdir -p "$out" && rm -rf "$scratch" && mkdir -p "$scratch" || return 2
summary=$out/summary.tsv
printf 'stage\trc\tseconds\tbudget_s\n' >"$summary"

# The GPU image lacks some of what `tessera`'s command line imports: install the carried wheels.
if ! "$py" -c "import celery, pydantic, redis" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "no .whl/ here and $py lacks celery/pydantic/redis: run scripts/gpu-prepare.sh and carry .whl" >&2
        return 2
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch/site" \
        .whl/*.whl || return 2
    export PYTHONPATH=$scratch/site
fi
export PYTHONPATH=$root/platform:$root${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

# stage NAME BUDGET_S: stage_NAME under `timeout`, capped by what is left before the deadline; stdout and
# stderr to OUT_DIR/NAME.log; one summary row. Skipped when the deadline is too close.
stage() {
    local name=$1 budget=$(($2 * scale)) start=$SECONDS rc
    if [ -n "${TESSERA_GPU_STAGES:-}" ] && [[ " $TESSERA_GPU_STAGES " != *" $name "* ]]; then
        case $name in
        llama-1b | quantize) [[ " $TESSERA_GPU_STAGES " == *" engine-"* ]] || return 0 ;;  # engines need them
        *) return 0 ;;
        esac
    fi
    local left=$((deadline - SECONDS - 5))
    if [ "$left" -lt 10 ]; then
        printf '%s\tskipped\t0\t0\n' "$name" >>"$summary"
        echo "== $name: skipped, the deadline is near"
        return 1
    fi
    [ "$budget" -gt "$left" ] && budget=$left
    echo "== $name (budget ${budget} s)"
    GPU_SESSION_STAGE=$name timeout -k 10 "$budget" bash "$self" "$out" "${@:3}" >"$out/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$budget" >>"$summary"
    echo "== $name: rc $rc in $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ', timed out')"
    return "$rc"
}
mode=()
[ "$smoke" = 1 ] && mode=(--smoke)

stage env 30 "${mode[@]}"
stage tests 150 "${mode[@]}" &  # the interpreter on the CPUs, while the GPU stages run
tests_pid=$!
stage kernel-check 90 "${mode[@]}"
stage kernels 60 "${mode[@]}"
stage int4-sweep 90 "${mode[@]}"
if [ -f "$cache" ]; then
    stage train 180 "${mode[@]}"
else  # no default-model work this session: nothing carried to train on
    printf 'train\toff\t0\t0\n' >>"$summary"
fi
if stage llama-1b 60 "${mode[@]}" && stage quantize 75 "${mode[@]}"; then
    stage engine-bf16-weights 110 "${mode[@]}"
    stage engine-graphs 60 "${mode[@]}"
    stage engine-int4-weights 60 "${mode[@]}"
    stage engine-int4-fast 60 "${mode[@]}"
    stage engine-fp8-weights 60 "${mode[@]}"
    stage step-profile 60 "${mode[@]}"
fi
wait "$tests_pid"

echo
column -t -s $'\t' "$summary" 2>/dev/null || cat "$summary"
echo "device: $device; logs and JSON in $out"
awk -F '\t' 'NR > 1 && $2 != "0" && $2 != "off" { failed = 1 } END { exit failed }' "$summary"  # 0: all passed
}

main "$@"

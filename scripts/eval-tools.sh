#!/usr/bin/env bash
# `tessera eval tools` over SmolLM2's memory formats, through the API: `tessera up` in a scratch data dir, one
# colocated deployment (and worker) per variant beside the default disaggregated one, then the suite on each.
#   scripts/eval-tools.sh [eval tools options...]   e.g. --mode required --limit 20
# Variants: bf16 (bf16 KV, weights dequantised to bf16), fp8kv (FP8-e4m3 KV), int8kv (INT8 KV, the default
# decode format) and int4 (the GGUF's own Q4_1 weights, bf16 KV). DEPLOY_FLAGS go to every deployment,
# the default one included (e.g. DEPLOY_FLAGS=--batch-invariant).
set -euo pipefail
DATA=$(mktemp -d)
echo "data dir (logs): $DATA" >&2
PORT=${PORT:-8797}
VARIANTS=${VARIANTS:-"bf16:bf16:bf16 fp8kv:fp8_e4m3:bf16 int8kv:int8:bf16 int4:bf16:int4"}
tessera up --port "$PORT" --data-dir "$DATA" >"$DATA/up.log" 2>&1 &
UP=$!
WORKERS=()
cleanup() {
    for pid in "${WORKERS[@]}"; do kill "$pid" 2>/dev/null || true; done
    kill -TERM "$UP" 2>/dev/null || true
    wait 2>/dev/null || true
}
trap cleanup EXIT
until grep -q "Ctrl-C stops everything" "$DATA/up.log"; do
    kill -0 "$UP" 2>/dev/null || { cat "$DATA/up.log"; exit 1; }
    sleep 1
done
KEY=$(sed -n 's/^API key: \(\S*\)$/\1/p' "$DATA/up.log" | head -1)
SOCKET=$(sed -n 's/.*embedded Redis: socket \(\S*\) (pid.*/\1/p' "$DATA/up.log" | head -1)
GGUF=$(python -c "import tessera; print(tessera.installed_smollm2())")
MODELS=(--model "default=@hf/smollm2-135m-instruct")
if [ -n "${DEPLOY_FLAGS:-}" ]; then
    # The default deployment's workers reload on the new config; the readiness loop below waits for them.
    tessera deployments update @hf/smollm2-135m-instruct --data-dir "$DATA" $DEPLOY_FLAGS >/dev/null
    python - "$PORT" "$KEY" <<'EOF'
import sys, time, httpx
port, key = sys.argv[1], sys.argv[2]
name = "@hf/smollm2-135m-instruct"
for _ in range(300):  # until both pools' workers serve config version 2 (none draining)
    pools = httpx.get(f"http://127.0.0.1:{port}/admin/pools", headers={"Authorization": f"Bearer {key}"},
                      timeout=60).json()["data"]
    mine = [p for p in pools if p["deployment"] == name]
    workers = {(w["config_version"], w["draining"]) for p in mine for w in p["workers"]}
    if sum(1 for p in mine if p["live_workers"]) == 2 and workers == {(2, False)}:
        break
    time.sleep(1)
else:
    sys.exit("the default deployment's workers did not reload")
EOF
fi
for variant in $VARIANTS; do
    IFS=: read -r label kv weights <<<"$variant"
    name="@eval/smollm2-$label"
    tessera deployments create "$name" --data-dir "$DATA" --checkpoint "$GGUF" --mode colocated \
        --prefill-kv "$kv" --prefill-weights "$weights" --max-num-seqs 16 --max-tokens-limit 4096 \
        ${DEPLOY_FLAGS:-} >/dev/null
    TESSERA_DATA_DIR="$DATA" TESSERA_REDIS_URL="redis+socket://$SOCKET" TESSERA_DATABASE_URL="sqlite:///$DATA/tessera.db" \
        OMP_NUM_THREADS=2 tessera worker --deployment "$name" --pool serve >"$DATA/worker-$label.log" 2>&1 &
    WORKERS+=($!)
    MODELS+=(--model "$label=$name")
done
# Each worker answers once its model is loaded: wait for every model to be listed and served.
for _ in $(seq 1 90); do
    ready=$(python - "$PORT" "$KEY" "${MODELS[@]}" <<'EOF'
import sys, httpx
port, key, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
ids = [s.split("=", 1)[1] for s in specs if s != "--model"]
ok = 0
for model in ids:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}, timeout=60)
    ok += r.status_code == 200
print(int(ok == len(ids)))
EOF
)
    [ "$ready" = 1 ] && break
    sleep 2
done
tessera eval tools --api-url "http://127.0.0.1:$PORT" --api-key "$KEY" "${MODELS[@]}" "$@"

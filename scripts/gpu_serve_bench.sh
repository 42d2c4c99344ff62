#!/usr/bin/env bash
# Serving benchmark of the GPU stack (run on the GPU machine after scripts/gpu_session.sh installed
# the carried wheels, i.e. as one of its steps): `halfmoon up` with the prefill worker on cuda:0 and
# the decode worker on cuda:1 (bf16, flashinfer, CUDA graphs, KV over UCX cuda_ipc), Llama-3.1-8B-shaped
# dummy weights whose vocabulary is the default model's tokenizer (scripts/make_gpu_model_dir.sh +
# the 8B shape), then `halfmoon bench serve` against the router: random 1024-in/128-out at concurrency
# 1, 8 and 32, and shared-prefix. Results: $RES/serve_gpu_<TAG><label>.json
# (RES defaults to $OUT).
#   [TAG=overlap_off_ DECODE_ARGS="--overlap-schedule off"] [PREFILL_N=2 PDEV=cuda:0] [ONLY="random_c32"] \
#     scripts/gpu_serve_bench.sh MODEL_DIR
set -u
model=${1:?model dir}
OUT=${OUT:-/tmp/out}
RES=${RES:-$OUT}  # where the result JSONs and logs go
mkdir -p "$RES"
ep=$(mktemp -u)
python3 -m halfmoon up --model "$model" --prefill "${PREFILL_N:-1}" --load-format dummy --dtype ${DTYPE:-bfloat16} --prefill-device ${PDEV:-cuda:0} \
  --decode-device ${DDEV:-cuda:1} --kv-memory-mb ${KV_MB:-40000} --base-port 0 --endpoints-file "$ep" \
  --log-dir "$RES/serve_logs" --ready-timeout 600 --decode-args "${DECODE_ARGS:-}" >"$RES/up.log" 2>&1 &
up=$!
for _ in $(seq 600); do [ -s "$ep" ] && break; kill -0 $up 2>/dev/null || break; sleep 1; done
if [ ! -s "$ep" ]; then echo "halfmoon up did not come up"; tail -30 "$RES/up.log"; kill $up; exit 1; fi
bench() {  # label, then bench serve args; ONLY="label ..." runs just those
  label=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $label "* ]]; then return; fi
  python3 -m halfmoon bench serve --endpoints "$ep" --tokenizer "$model" --ignore-eos --seed 0 --no-progress --no-requests \
    --label "${TAG:-}$label" --output "$RES/serve_gpu_${TAG:-}$label.json" "$@" 2>&1 | tail -22
}
bench random_c1 --workload random --input-len 1024 --output-len 128 --num-requests 8 --concurrency 1 --warmup 2
bench random_c8 --workload random --input-len 1024 --output-len 128 --num-requests 48 --concurrency 8 --warmup 4
bench random_c32 --workload random --input-len 1024 --output-len 128 --num-requests 128 --concurrency 32 --warmup 8
bench shared_prefix_c8 --workload shared-prefix --groups 4 --prefix-len 2048 --suffix-len 128 --output-len 64 \
  --num-requests 48 --concurrency 8 --warmup 4
kill $up; wait $up

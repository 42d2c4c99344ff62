#!/usr/bin/env bash
# Decode memory on the GPU (one H200): `--decode-reserve ondemand` vs `full` on `halfmoon up` with
# the prefill and the decode worker sharing cuda:0, Llama-3.1-8B-shaped dummy weights (bf16) with a
# 4096-token context, D's pool sized for 64 requests of 4k context (32 GiB = 262,144 tokens), 256
# concurrent requests. Requests leave max_tokens unset (the rest of the context, as an OpenAI client
# does) and the client stops reading at a drawn length (`bench serve --advertise-max-tokens ${ADV:-3072}`):
# dummy weights never emit EOS, so this stands in for a natural stop D cannot know in advance.
#   MODES="ondemand full" scripts/gpu_memory_bench.sh MODEL_DIR   (run after scripts/gpu_session.sh set-up)
set -u
model=${1:?model dir}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for mode in ${MODES:-ondemand full}; do
  ep=$(mktemp -u)
  python3 -m halfmoon up --model "$model" --load-format dummy --dtype bfloat16 --prefill-device cuda:0 \
    --decode-device cuda:0 --kv-memory-mb ${P_KV_MB:-8192} --decode-kv-memory-mb ${D_KV_MB:-32768} --base-port 0 \
    --endpoints-file "$ep" --log-dir "$OUT/mem_logs_$mode" --ready-timeout 600 \
    --decode-args="--decode-reserve $mode --max-running-requests 256" >"$OUT/up_$mode.log" 2>&1 &
  up=$!
  for _ in $(seq 600); do [ -s "$ep" ] && break; kill -0 $up 2>/dev/null || break; sleep 1; done
  if [ ! -s "$ep" ]; then echo "halfmoon up ($mode) did not come up"; tail -30 "$OUT/up_$mode.log"; kill $up; continue; fi
  echo "=== $mode up after ${SECONDS}s"
  python3 -m halfmoon bench serve --endpoints "$ep" --tokenizer "$model" --ignore-eos --seed 0 --no-progress \
    --no-requests --label "mem_$mode" --output "$OUT/gpu_memory_$mode.json" --workload random \
    --input-len ${IN:-512} --output-len ${OUTLEN:-256} --range-ratio 0.5 --advertise-max-tokens ${ADV:-3072} \
    --num-requests ${N:-768} --concurrency ${C:-256} --warmup 8 2>&1 | tail -24
  grep -h "retract\|Traceback\|ERROR" "$OUT/mem_logs_$mode"/decode-0*.log 2>/dev/null | tail -5
  kill $up; wait $up
done

#!/usr/bin/env bash
# Where a served decode step's time goes under load on the GPU: `halfmoon up` (P and D on cuda:0, the
# 8B shape), `bench serve` at concurrency C, and, while it runs, each process's CPU share (top) and
# py-spy samples of D, P and the router (speedscope JSON + a dump of D's threads).
#   scripts/gpu_serve_profile.sh MODEL_DIR   (after scripts/gpu_session.sh set-up; py-spy on PYTHONPATH/bin)
set -u
model=${1:?model dir}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=${MODE:-ondemand}
ep=$(mktemp -u)
python3 -m halfmoon up --model "$model" --load-format dummy --dtype bfloat16 --prefill-device cuda:0 \
  --decode-device cuda:0 --kv-memory-mb ${P_KV_MB:-8192} --decode-kv-memory-mb ${D_KV_MB:-32768} --base-port 0 \
  --endpoints-file "$ep" --log-dir "$OUT/prof_logs" --ready-timeout 600 \
  --decode-args="--decode-reserve $mode --max-running-requests 256 ${D_ARGS:-}" >"$OUT/up_prof.log" 2>&1 &
up=$!
for _ in $(seq 600); do [ -s "$ep" ] && break; kill -0 $up 2>/dev/null || break; sleep 1; done
[ -s "$ep" ] || { echo "halfmoon up did not come up"; tail -30 "$OUT/up_prof.log"; kill $up; exit 1; }
echo "=== up after ${SECONDS}s"
python3 -m halfmoon bench serve --endpoints "$ep" --tokenizer "$model" --ignore-eos --seed 0 --no-progress \
  --no-requests --label "prof_$mode" --output "$OUT/prof_$mode.json" --workload random \
  --input-len ${IN:-512} --output-len ${OUTLEN:-256} --range-ratio 0.5 --advertise-max-tokens ${ADV:-3072} \
  --num-requests ${N:-512} --concurrency ${C:-256} --warmup 8 >"$OUT/bench_prof.log" 2>&1 &
bench=$!
sleep ${SETTLE:-15}
spy=${PYSPY:-py-spy}
pid_of() { pgrep -f "halfmoon $1" | head -1; }
top -b -n 2 -d 3 -w 250 | tail -n +1 > "$OUT/top.txt"
spies=()
for role in serve-decode serve-prefill serve-router; do
  pid=$(pid_of $role); [ -n "$pid" ] || continue
  $spy dump --pid "$pid" > "$OUT/dump_$role.txt" 2>&1
  $spy record --pid "$pid" --duration ${DUR:-8} --rate 200 --format speedscope -o "$OUT/spy_$role.json" \
    >"$OUT/spy_$role.log" 2>&1 &
  spies+=($!)
done
for p in "${spies[@]}"; do wait $p; done
wait $bench; tail -30 "$OUT/bench_prof.log"
kill $up; wait $up
(cd "$OUT" && tar -czf profile.tgz top.txt dump_* spy_* prof_logs up_prof.log bench_prof.log && rm -rf top.txt dump_* spy_* prof_logs)

#!/usr/bin/env bash
# Session 23, call 2 (GPU_NOTES.md): decode with MID_BATCH_CONFIG (the new default for 32-47
# requests) | the old shape (LARGE_BATCH_CONFIG, patched in before the bench runs) interleaved twice,
# B = 24, 32, 48 at ctx 1k and 4k (24 and 48 do not change: controls); the GPU tests (ops carried).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() {  # $1: new | old, $2: run number
  step "decode $1 run $2"
  timeout 100 python3 -c "
import sys, engine.attention.split_kv_decode as m
if '$1' == 'old': m.MID_BATCH_CONFIG = m.LARGE_BATCH_CONFIG
from bench.gpu import main
sys.exit(main(['decode', '--iters', '20', '--batches', '24,32,48', '--contexts', '1024,4096',
               '--eager-batches', '0', '--out', '$OUT/d-$1-$2.json']))" 2>&1 | keep_rows
}
for i in 1 2; do run new $i; run old $i; done
step gpu_tests
timeout 250 bash -c "$(declare -f gpu_tests); gpu_tests"
step done

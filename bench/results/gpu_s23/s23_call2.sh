#!/usr/bin/env bash
# Session 23, call 2 (GPU_NOTES.md; not run: no machine lent): decode with the candidate shape for
# 32-47 requests (128-token tiles, 2 stages, one program an SM, patched into default_config in the
# bench process) | the shipped default interleaved twice,
# B = 24, 32, 48 at ctx 1k and 4k (24 and 48 do not change: controls); the GPU tests in the time left
# (they compile the flashinfer ops when the checkout lacks gpu-cache/; the ops go back to $OUT).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() {  # $1: new | old, $2: run number
  step "decode $1 run $2"
  timeout 100 python3 -c "
import sys, engine.attention.split_kv_decode as m
if '$1' == 'new':
    base, mid = m.default_config, m.SplitConfig(block_n=128, stages=2, ctas_per_sm=1)
    m.default_config = lambda b: mid if 32 <= b <= 47 else base(b)
from bench.gpu import main
sys.exit(main(['decode', '--iters', '20', '--batches', '24,32,48', '--contexts', '1024,4096',
               '--eager-batches', '0', '--out', '$OUT/d-$1-$2.json']))" 2>&1 | keep_rows
}
for i in 1 2; do run new $i; run old $i; done
left=$(( 565 - ($(date +%s) - t0) ))
step "gpu_tests (${left} s left)"
timeout $left bash -c "$(declare -f gpu_tests); gpu_tests"
save_ops
step done

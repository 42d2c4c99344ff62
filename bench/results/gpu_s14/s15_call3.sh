#!/usr/bin/env bash
# Session 15, call 3 (GPU_NOTES.md): decode graphs with the tuned GEMM's default (cublaslt on the
# buckets of 2-32 rows) against off, interleaved twice; then the GPU tests with the default on.
set -u
source scripts/gpu_call_env.sh
step ceilings
python3 -m bench.gpu ceilings --out "$OUT/ceilings.json" 2>&1 | tail -1
read bw rate < <(python3 -c "import json; c = json.load(open('$OUT/ceilings.json'))['ceilings']; print(c['copy_bw_Bps'], c['gemm_flops'])")
for i in 1 2; do
  for be in off default; do
    step "decode $be $i"
    # two pools: B=128 at ctx 4k needs 64 GiB of KV, which an H100 lacks beside the 16 GB of weights
    for grid in "1,2,4,8,16,32,64,128 1024" "1,4,16,32,64 4096"; do
      set -- $grid
      HALFMOON_TUNED_GEMM=$be timeout 80 python3 -m bench.gpu decode --copy-bw $bw --gemm-rate $rate \
        --iters 30 --batches $1 --contexts $2 --out "$OUT/d-$be-$i-$2.json" 2>&1 | grep -E '^ +[0-9]+ +[0-9]+ ' | cut -c1-84
    done
  done
done
step "gpu tests"
gpu_tests; cp /tmp/gpu_tests.log "$OUT/gpu_tests.log"
step done

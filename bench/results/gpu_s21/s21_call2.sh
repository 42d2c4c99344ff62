#!/usr/bin/env bash
# Session 21, call 2 (GPU_NOTES.md): the GPU tests with the fixed graph-vs-eager expectation; the
# shipped default against every bucket forced to split_kv on the same machine (session 20's call 4
# question); the o GEMM with its weight in L2 or not (o_gemm_l2.py); graph_profile of the default.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step o_gemm_l2
timeout 60 python3 bench/results/gpu_s21/o_gemm_l2.py 2>&1 | grep -E "^o_gemm_l2|Error" | cut -c1-200
step gpu_tests
timeout 200 bash -c "$(declare -f gpu_tests); gpu_tests"
for i in 1 2; do
  for be in "" split_kv; do
    step "decode HALFMOON_DECODE_ATTN='$be' run $i"
    HALFMOON_DECODE_ATTN=$be timeout 60 python3 -m bench.gpu decode --iters 20 --batches 1,4,32,64 --contexts 1024,4096 \
      --eager-batches 0 --out "$OUT/d-${be:-default}-$i.json" 2>&1 | keep_rows
  done
done
step graph_profile
timeout 120 python3 -m bench.gpu graph_profile --profile-cases 1x1024,32x1024 --out "$OUT/gprof.json" 2>&1 \
  | grep -E "^graph_profile|^ +[0-9.]+ us|Error" | cut -c1-160
step done

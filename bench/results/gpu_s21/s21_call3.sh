#!/usr/bin/env bash
# Session 21, call 3 (GPU_NOTES.md): the final tree (bucket 4 in SPLIT_KV_BUCKETS): the GPU tests, then
# decode with HALFMOON_DECODE_ATTN unset and forced to split_kv (B = 1, 4, 8; ctx 1k, 4k).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step gpu_tests
timeout 200 bash -c "$(declare -f gpu_tests); gpu_tests"
for be in "" split_kv; do
  step "decode HALFMOON_DECODE_ATTN='$be'"
  HALFMOON_DECODE_ATTN=$be timeout 60 python3 -m bench.gpu decode --iters 20 --batches 1,4,8 --contexts 1024,4096 \
    --eager-batches 0 --out "$OUT/d-${be:-default}.json" 2>&1 | keep_rows
done
step done

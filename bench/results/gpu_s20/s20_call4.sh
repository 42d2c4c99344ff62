#!/usr/bin/env bash
# Session 20, call 4 (GPU_NOTES.md): the shipped default (split_kv in buckets 1-128 but 4): the GPU
# tests, then decode replay with HALFMOON_DECODE_ATTN unset at ctx 1k and 4k.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step gpu_tests
timeout 120 bash -c "$(declare -f gpu_tests); gpu_tests"
step "decode default"
timeout 90 python3 -m bench.gpu decode --iters 20 --batches 1,4,32,64 --contexts 1024,4096 --eager-batches 0 \
  --out "$OUT/d-default.json" 2>&1 | keep_rows
step done

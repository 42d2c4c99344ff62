#!/usr/bin/env bash
# Session 19, call 2 (GPU_NOTES.md): the shipped default (split_kv in buckets 1, 2, 8, 16): the GPU
# unit tests by file, then decode replay with HALFMOON_DECODE_ATTN unset.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
step gpu_tests
timeout 280 bash -c "$(declare -f gpu_tests); gpu_tests"
step "decode default"
timeout 60 python3 -m bench.gpu decode --iters 30 --batches 1,2,4,8,16,32 --contexts 1024 --eager-batches 0 \
  --out "$OUT/d1k-default.json" 2>&1 | grep -E '^ +[0-9]+ +[0-9]+ |Error' | cut -c1-84
step done

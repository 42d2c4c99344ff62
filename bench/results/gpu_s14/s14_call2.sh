#!/usr/bin/env bash
# Session 14, call 2 (GPU_NOTES.md): decode graphs with the tuned GEMM off / cublaslt / auto,
# interleaved twice over B = 1, 8, 16, 32, 64, 128 and ctx 1k, 4k. The first run of each backend
# tunes and writes its choices to a cache file; the second reads them (what a restart does).
set -u
source scripts/gpu_call_env.sh
for i in 1 2; do
  for be in off cublaslt auto; do
    step "decode $be $i"
    HALFMOON_TUNED_GEMM=$be HALFMOON_TUNED_GEMM_CACHE=/tmp/tuned-$be.json timeout 150 python3 -m bench.gpu decode \
      --iters 30 --batches 1,8,16,32,64,128 --contexts 1024,4096 --out "$OUT/decode-$be-$i.json" 2>&1 \
      | grep -v '^{' | tail -13 | cut -c1-84
  done
done
step done

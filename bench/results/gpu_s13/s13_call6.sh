#!/usr/bin/env bash
# Session 13, call 6 (GPU_NOTES.md): decode graphs captured under cuBLASLt vs torch's default BLAS
# now that o/down at <= 8 rows are on tinygemm (session 11's cuBLASLt loss was at B=8, in down),
# interleaved twice over B = 1, 8, 16, 32, 64, 128 and ctx 1k, 4k.
set -u
source scripts/gpu_call_env.sh
for i in 1 2; do
  for lib in default cublaslt; do
    step "decode $lib $i"
    HALFMOON_DECODE_GRAPH_BLAS=$([ $lib = default ] && echo "" || echo $lib) python3 -m bench.gpu decode --iters 30 \
      --batches 1,8,16,32,64,128 --contexts 1024,4096 --out /tmp/d.json 2>&1 | grep -v '^{' | tail -13 | cut -c1-84
  done
done
step done

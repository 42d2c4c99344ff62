#!/usr/bin/env bash
# Session 18, call 2 (GPU_NOTES.md): decode graphs with the wrapper / split_kv in every bucket
# (HALFMOON_DECODE_ATTN), interleaved twice: B = 1-128 at ctx 1k, B = 1-64 at ctx 4k (a pool for
# B=128 at 4k is 69 GB of KV: more than an H100 holds beside the weights).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for i in 1 2; do
  for be in flashinfer split_kv; do
    step "decode $be $i"
    HALFMOON_DECODE_ATTN=$be timeout 100 python3 -m bench.gpu decode --iters 30 --batches 1,2,4,8,16,32,64,128 \
      --contexts 1024 --eager-batches 0 --out "$OUT/d1k-$be-$i.json" 2>&1 | grep -E '^ +[0-9]+ +[0-9]+ |Error' | cut -c1-84
    HALFMOON_DECODE_ATTN=$be timeout 100 python3 -m bench.gpu decode --iters 30 --batches 1,2,4,8,16,32,64 \
      --contexts 4096 --eager-batches 0 --out "$OUT/d4k-$be-$i.json" 2>&1 | grep -E '^ +[0-9]+ +[0-9]+ |Error' | cut -c1-84
  done
done
step done

#!/usr/bin/env bash
# Session 20, call 3 (GPU_NOTES.md): the kernel with req_to_token slots narrowed to int32 after the
# load: split_kv_factors, the GPU tests, then decode replay with the wrapper / split_kv in every bucket
# interleaved twice (ctx 1k: B = 1-128, ctx 4k: B = 1-64, every graph bucket between).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step split_kv_factors
timeout 90 python3 -m bench.gpu split_kv_factors --micro-cases 64x1024,64x4096,128x1024 --out "$OUT/factors.json" 2>&1 \
  | grep -E "^split_kv_factors|Error" | cut -c1-260
step gpu_tests
timeout 200 bash -c "$(declare -f gpu_tests); gpu_tests"
for i in 1 2; do
  for be in flashinfer split_kv; do
    step "decode $be $i"
    HALFMOON_DECODE_ATTN=$be timeout 60 python3 -m bench.gpu decode --iters 20 --batches 1,2,4,8,12,16,24,32,48,64,96,128 \
      --contexts 1024 --eager-batches 0 --out "$OUT/d1k-$be-$i.json" 2>&1 | keep_rows
    HALFMOON_DECODE_ATTN=$be timeout 60 python3 -m bench.gpu decode --iters 20 --batches 1,2,4,8,12,16,24,32,48,64 \
      --contexts 4096 --eager-batches 0 --out "$OUT/d4k-$be-$i.json" 2>&1 | keep_rows
  done
done
step done

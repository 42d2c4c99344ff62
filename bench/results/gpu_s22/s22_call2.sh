#!/usr/bin/env bash
# Session 22, call 2 (GPU_NOTES.md): the final tree (PDL on by default): decode default | PDL "0",
# prefill 8k, the GPU tests; the compiled flashinfer ops back in $OUT (7 files in all).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for pdl in "" 0; do
  step "decode PDL='$pdl'"
  HALFMOON_DECODE_PDL=$pdl timeout 150 python3 -m bench.gpu decode --iters 20 --batches 1,8,32,64,128 \
    --contexts 1024 --eager-batches 0 --out "$OUT/d1k-pdl${pdl:-default}.json" 2>&1 | keep_rows
  HALFMOON_DECODE_PDL=$pdl timeout 120 python3 -m bench.gpu decode --iters 20 --batches 1,8,32,64 \
    --contexts 4096 --eager-batches 0 --out "$OUT/d4k-pdl${pdl:-default}.json" 2>&1 | keep_rows
done
step prefill
timeout 150 python3 -m bench.gpu ceilings prefill --out "$OUT/prefill.json" 2>&1 | grep -E "^ceilings|^prefill|paged kernels|Error" | cut -c1-140
save_ops
step gpu_tests
timeout 280 bash -c "$(declare -f gpu_tests); gpu_tests"
save_ops
ls -la "$OUT"
step done

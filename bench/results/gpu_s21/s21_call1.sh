#!/usr/bin/env bash
# Session 21, call 1 (GPU_NOTES.md): l2_prefetch_micro (q/k/v + split-KV attention + o of 32 layers,
# with the o weight prefetched into L2 during the attention or not), the GPU tests, then decode with
# the shipped default (HALFMOON_DECODE_ATTN unset: session 20's call 4) with HALFMOON_L2_PREFETCH off
# and o, interleaved twice. The section and the switch were removed after this run (they lost; see
# GPU_NOTES.md): the script runs on commit 5168c55, not on later trees.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step l2_prefetch_micro
timeout 150 python3 -m bench.gpu l2_prefetch_micro --out "$OUT/l2.json" 2>&1 | grep -E "^l2_prefetch_micro|Error|error" | cut -c1-300
step gpu_tests
timeout 200 bash -c "$(declare -f gpu_tests); gpu_tests"
for i in 1 2; do
  for pf in off o; do
    step "decode default, L2 prefetch $pf, run $i"
    HALFMOON_L2_PREFETCH=$pf timeout 80 python3 -m bench.gpu decode --iters 20 --batches 1,4,8,32,64 --contexts 1024,4096 \
      --eager-batches 0 --out "$OUT/d-$pf-$i.json" 2>&1 | keep_rows
  done
done
step done

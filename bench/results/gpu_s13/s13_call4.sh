#!/usr/bin/env bash
# Session 13, call 4 (GPU_NOTES.md): the RoPE + K/V store kernel launched with PDL (Triton
# launch_pdl, gdc_wait before q/k/v): GPU tests (asserts printed), decode default (PDL on) vs
# HALFMOON_ROPE_STORE_PDL=0 vs q/k/v also on tinygemm, interleaved twice; prefill + prefill_parts.
set -u
source scripts/gpu_call_env.sh
step "GPU tests"
gpu_tests
for i in 1 2; do
  for v in default nopdl qkv; do
    step "decode $v $i"
    HALFMOON_ROPE_STORE_PDL=$([ $v = nopdl ] && echo 0 || echo 1) \
    HALFMOON_SMALL_M_GEMM_ON=$([ $v = qkv ] && echo o,down,qkv || echo o,down) python3 -m bench.gpu decode --iters 30 \
      --batches 1,8,32,128 --contexts 1024,4096 --out /tmp/d.json 2>&1 | grep -v '^{' | tail -9 | cut -c1-84
  done
done
step "prefill prefill_parts"
python3 -m bench.gpu prefill prefill_parts --iters 20 --prefill-backends fa3 --out /tmp/p.json 2>&1 | grep -v '^{' \
  | grep -i -E "prefill|ms|error|Traceback" | tail -16 | cut -c1-120
step done

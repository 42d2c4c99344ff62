#!/usr/bin/env bash
# Session 16, call 2 (GPU_NOTES.md): the MLP's gate/up GEMM + SiLU·mul at 8192 and 2048 tokens,
# cuBLAS + flashinfer against the fused Triton kernel (engine/gate_up_silu.py) per tile and variant.
set -u
source scripts/gpu_call_env.sh
step gate_up_micro
timeout 200 python3 -m bench.gpu gate_up_micro --out "$OUT/gate_up.json" 2>&1 \
  | grep -vE "^gate_up_micro \{" | grep -E "^gate_up_micro|^ +[a-z0-9_+]+ |Error" | cut -c1-150
step done

#!/usr/bin/env bash
# Session 16, call 1 (GPU_NOTES.md): a whole prompt's causal attention alone, per kernel family
# (bench/gpu_prefill_attn.py), at 8192 and 2048 tokens, 32 layers of distinct q/k/v.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
step prefill_attn
timeout 420 python3 -m bench.gpu ceilings prefill_attn --out "$OUT/prefill_attn.json" 2>&1 \
  | grep -vE "^prefill_attn \{" | grep -E "^ceilings|^prefill_attn|^ +[a-z0-9_]+ +[0-9]+ |Error|error" | cut -c1-160
step done

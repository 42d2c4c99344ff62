#!/usr/bin/env bash
# Session 20, call 2 (GPU_NOTES.md): split_kv_factors at B=64 (ctx 1k, 4k), then the GPU tests with
# the compiled flashinfer ops carried (gpu-cache/).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step split_kv_factors
timeout 150 python3 -m bench.gpu split_kv_factors --micro-cases 64x1024,64x4096,128x1024 --out "$OUT/factors.json" 2>&1 \
  | grep -E "^split_kv_factors|Error" | cut -c1-260
step gpu_tests
timeout 300 bash -c "$(declare -f gpu_tests); gpu_tests"
step done

#!/usr/bin/env bash
# Session 14, call 1 (GPU_NOTES.md): flashinfer's autotuned mm_bf16 (engine/tuned_gemm.py, env
# HALFMOON_TUNED_GEMM): the GPU tests by file with its new cases (a cold machine JIT-compiles
# everything: the .so files come back in $OUT for gpu-cache/), then the GEMMs alone (small_gemm:
# cuBLAS, cuBLASLt, tinygemm, and mm_bf16 tuned with cublaslt / cudnn / auto, M = 1-128 and 8192).
set -u
source scripts/gpu_call_env.sh
step "gpu tests (cold JIT)"
gpu_tests
(cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/flashinfer-so.tar.gz" -T -) 2>/dev/null
step small_gemm
timeout 200 python3 -m bench.gpu small_gemm --out "$OUT/small_gemm.json" 2>&1 | grep small_gemm | cut -c1-110
step done

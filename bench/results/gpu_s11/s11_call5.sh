#!/usr/bin/env bash
# Session 11, call 5 (GPU_NOTES.md): small-M GEMMs per BLAS library; decode graphs under each.
set -u
source scripts/gpu_call_env.sh
step small_gemm
python3 -m bench.gpu small_gemm --out /tmp/sg.json 2>&1 | grep "^small_gemm"
for i in 1 2; do
  for lib in default cublaslt; do
    step "decode blas=$lib $i"
    HALFMOON_DECODE_GRAPH_BLAS=$([ $lib = default ] && echo "" || echo $lib) python3 -m bench.gpu decode --iters 30 \
      --batches 1,8,32,128 --contexts 1024,4096 --out /tmp/d_${lib}_$i.json 2>&1 | grep -v '^{' | tail -8 | cut -c1-80
  done
done
step done

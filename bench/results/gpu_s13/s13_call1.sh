#!/usr/bin/env bash
# Session 13, call 1 (GPU_NOTES.md): flashinfer's tinygemm for the decode projections at <= 8 rows
# (env HALFMOON_SMALL_M_GEMM): GPU tests with it on (tinygemm2 is JIT-compiled here: its .so comes
# back in $OUT), the GEMMs alone (small_gemm), decode cuBLAS / tinygemm / tinygemm without PDL
# interleaved, and the B=1 graph profile with tinygemm.
set -u
source scripts/gpu_call_env.sh
step "tests (tinygemm JIT)"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_small_m_gemm.py 2>&1 | tail -4
(cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/tinygemm-so.tar.gz" -T -) 2>/dev/null
HALFMOON_SMALL_M_GEMM=tinygemm python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_gpu_flashinfer.py \
  tests/unit/test_rope_kv_store.py tests/unit/test_flashinfer_plan_fence.py 2>&1 | tail -4
step small_gemm
python3 -m bench.gpu small_gemm --out /tmp/g.json 2>&1 | grep small_gemm | cut -c1-100
for i in 1 2; do
  for mode in cublas tinygemm tinygemm_nopdl; do
    step "decode $mode $i"
    HALFMOON_SMALL_M_GEMM=$mode python3 -m bench.gpu decode --iters 30 --batches 1,2,4,8,32 \
      --contexts 1024,4096 --out /tmp/d.json 2>&1 | grep -v '^{' | tail -14 | cut -c1-100
  done
done
step "graph_profile tinygemm"
HALFMOON_SMALL_M_GEMM=tinygemm timeout 120 python3 -m bench.gpu graph_profile --out /tmp/gp.json 2>&1 \
  | grep -v '^{' | head -20 | cut -c1-140
step done

#!/usr/bin/env bash
# Session 13, call 3 (GPU_NOTES.md): the new default (tinygemm on o + down at <= 8 rows) through the
# unit GPU tests (asserts printed), the model-vs-transformers file three times (call 1's failures),
# decode default vs cuBLAS interleaved twice on the grid, and the default's graph profile.
set -u
source scripts/gpu_call_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step "unit GPU tests"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit --tb=short 2>&1 | grep -E "^E |passed|failed|^FAILED" | cut -c1-300 | head -20
for i in 1 2 3; do
  step "model vs transformers $i"
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_gpu_flashinfer.py tests/unit/test_small_m_gemm.py \
    --tb=short 2>&1 | grep -E "^E |passed|failed" | cut -c1-300 | head -8
done
for i in 1 2; do
  for mode in auto cublas; do
    step "decode $mode $i"
    HALFMOON_SMALL_M_GEMM=$mode python3 -m bench.gpu decode --iters 30 --batches 1,8,32,128 \
      --contexts 1024,4096 --out /tmp/d.json 2>&1 | grep -v '^{' | tail -9 | cut -c1-84
  done
done
step "graph_profile default"
timeout 120 python3 -m bench.gpu graph_profile --out /tmp/gp.json 2>&1 | grep -v '^{' | grep -v -i warn | head -14 | cut -c1-120
step done

#!/usr/bin/env bash
# Session 13, call 7 (GPU_NOTES.md): the stop's final tree (tinygemm on o + down at <= 8 rows,
# buckets >= 32 under cuBLASLt, the small-M choice moved to engine/small_m_gemm.py): GPU tests by
# file, decode on the grid twice, graph_profile at B=1 and 32.
set -u
source scripts/gpu_call_env.sh
step "GPU tests"
gpu_tests
for i in 1 2; do
  step "decode default $i"
  python3 -m bench.gpu decode --iters 30 --batches 1,8,32,128 --contexts 1024,4096 --out /tmp/d.json 2>&1 \
    | grep -v '^{' | tail -9 | cut -c1-84
done
step graph_profile
timeout 150 python3 -m bench.gpu graph_profile --out /tmp/gp.json 2>&1 | grep -v '^{' | grep -v -i warn \
  | grep -E "graph_profile|  [0-9]" | head -26 | cut -c1-110
step done

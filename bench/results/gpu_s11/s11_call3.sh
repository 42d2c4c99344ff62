#!/usr/bin/env bash
# Session 11, call 3 (GPU_NOTES.md): graph replay kernel profile, tensor-core vs CUDA-core decode.
set -u
source scripts/gpu_call_env.sh
for tc in 1 0; do
  step "graph_profile tc=$tc"
  HALFMOON_FLASHINFER_DECODE_TENSOR_CORES=$tc python3 -m bench.gpu graph_profile --out $OUT/c3_gprof_tc$tc.json 2>&1 \
    | grep -v '^{' > $OUT/c3_gprof_tc$tc.log; grep -A17 "graph_profile B" $OUT/c3_gprof_tc$tc.log | cut -c1-110
done
for i in 1 2; do
  for tc in 1 0; do
    step "decode tc=$tc $i"
    HALFMOON_FLASHINFER_DECODE_TENSOR_CORES=$tc python3 -m bench.gpu decode --iters 30 --batches 1,8,32,128 \
      --contexts 1024,4096 --out $OUT/c3_dec_tc${tc}_$i.json 2>&1 | grep -v '^{' | tail -9 | tee $OUT/c3_dec_tc${tc}_$i.log
  done
done
step done

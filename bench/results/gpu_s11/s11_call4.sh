#!/usr/bin/env bash
# Session 11, call 4 (GPU_NOTES.md): graph decode with flashinfer's split-KV off vs on.
set -u
source scripts/gpu_call_env.sh
step "graph vs eager, no split"
HALFMOON_FLASHINFER_DECODE_NO_SPLIT_FROM=1 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/unit/test_gpu_flashinfer.py -k "graph_decode or transformers" 2>&1 | tail -3
step "graph_profile no split"
HALFMOON_FLASHINFER_DECODE_NO_SPLIT_FROM=1 python3 -m bench.gpu graph_profile --out /tmp/gp.json 2>&1 \
  | grep -A8 "graph_profile B" | cut -c1-110
for i in 1 2; do
  for ns in 1 0; do
    step "decode no_split_from=$ns $i"
    HALFMOON_FLASHINFER_DECODE_NO_SPLIT_FROM=$ns python3 -m bench.gpu decode --iters 30 --batches 1,8,32,128 \
      --contexts 1024,4096 --out /tmp/d_${ns}_$i.json 2>&1 | grep -v '^{' | tail -8 | cut -c1-80
  done
done
step done

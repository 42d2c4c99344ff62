#!/usr/bin/env bash
# Session 20, call 1 (GPU_NOTES.md): the shipped default's GPU tests and decode (session 19's call 2),
# then why split_kv's graph replay loses from B=32 up where its micro wins: the micro in the engine's
# page-major KV layout beside the layer-major one, the graph's kernels at B=64, and decode replay
# with a layer-major pool.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step gpu_tests
timeout 150 bash -c "$(declare -f gpu_tests); gpu_tests"
save_ops
step "decode default"
timeout 60 python3 -m bench.gpu decode --iters 30 --batches 1,2,4,8,16,32 --contexts 1024 --eager-batches 0 \
  --out "$OUT/d1k-default.json" 2>&1 | keep_rows
M="32x1024,64x1024,128x1024,32x4096,64x4096"
for lay in page_major layer_major; do
  step "split_kv_micro $lay"
  timeout 90 python3 -m bench.gpu split_kv_micro --kv-layout $lay --micro-cases $M --out "$OUT/micro-$lay.json" 2>&1 \
    | grep -E "^split_kv_micro B|Error" | cut -c1-170
done
step "graph_profile split_kv"
HALFMOON_DECODE_ATTN=split_kv timeout 90 python3 -m bench.gpu graph_profile --profile-cases 64x4096,64x1024 \
  --out "$OUT/gprof-split_kv.json" 2>&1 | grep -E "^graph_profile|^ +[0-9.]+ us|Error" | cut -c1-150
for lay in layer_major page_major; do
  step "decode split_kv $lay"
  HALFMOON_DECODE_ATTN=split_kv timeout 50 python3 -m bench.gpu decode --iters 20 --batches 32,64 --contexts 4096 \
    --eager-batches 0 --kv-layout $lay --out "$OUT/d4k-split_kv-$lay.json" 2>&1 | keep_rows
done
step done

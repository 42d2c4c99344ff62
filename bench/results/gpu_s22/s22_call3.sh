#!/usr/bin/env bash
# Session 22, call 3 (GPU_NOTES.md; not run, needs commit 8358d59, whose switch was removed again): decode PDL default | HALFMOON_DECODE_PDL_HOIST=1 interleaved
# twice (B = 1, 8, 32 at ctx 1k and 4k, one process a run: ~300 s of device time were left), then the
# GPU tests of the split-KV kernel, the store and the graph (ops carried in gpu-cache/).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for i in 1 2; do
  for hoist in "" 1; do
    step "decode HOIST='$hoist' run $i"
    HALFMOON_DECODE_PDL_HOIST=$hoist timeout 60 python3 -m bench.gpu decode --iters 20 --batches 1,8,32 \
      --contexts 1024,4096 --eager-batches 0 --out "$OUT/d-hoist${hoist:-0}-$i.json" 2>&1 | keep_rows
  done
done
step tests
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/unit/test_split_kv_decode.py \
  tests/unit/test_rope_kv_store.py tests/unit/test_gpu_flashinfer.py -k "compiled_kernel or graph_decode_equals_eager or gpu_matches" \
  > /tmp/t.log 2>&1; grep -E "^E |^FAILED|^ERROR" /tmp/t.log | cut -c1-300 | head -12; grep -E "[0-9]+ (passed|failed)" /tmp/t.log | tail -1
step done

#!/usr/bin/env bash
# Session 19, call 1 (GPU_NOTES.md): session 18's two calls in one (device starts fail often):
# the split_kv GPU tests, decode graphs with the wrapper / split_kv in every bucket
# (HALFMOON_DECODE_ATTN) interleaved twice (B = 1-128 at ctx 1k, B = 1-64 at ctx 4k), then
# split_kv_micro on 16 cases. Saves the compiled flashinfer ops for later calls.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step "split_kv tests"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/unit/test_split_kv_decode.py \
  tests/unit/test_gpu_flashinfer.py -k "compiled_kernel or graph_decode_equals_eager" > "$OUT/tests.log" 2>&1
grep -E "^E |^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests.log"
save_ops
for i in 1 2; do
  for be in flashinfer split_kv; do
    step "decode $be $i"
    HALFMOON_DECODE_ATTN=$be timeout 60 python3 -m bench.gpu decode --iters 30 --batches 1,2,4,8,16,32,64,128 \
      --contexts 1024 --eager-batches 0 --out "$OUT/d1k-$be-$i.json" 2>&1 | grep -E '^ +[0-9]+ +[0-9]+ |Error' | cut -c1-84
    HALFMOON_DECODE_ATTN=$be timeout 60 python3 -m bench.gpu decode --iters 30 --batches 1,2,4,8,16,32,64 \
      --contexts 4096 --eager-batches 0 --out "$OUT/d4k-$be-$i.json" 2>&1 | grep -E '^ +[0-9]+ +[0-9]+ |Error' | cut -c1-84
  done
  save_ops
done
step split_kv_micro
timeout 100 python3 -m bench.gpu split_kv_micro --out "$OUT/split_kv.json" 2>&1 | grep -E "^split_kv_micro B|Error" | cut -c1-170
step done

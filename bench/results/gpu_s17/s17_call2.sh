#!/usr/bin/env bash
# Session 17, call 2 (GPU_NOTES.md): the split-KV Triton decode attention (engine/attention/
# split_kv_decode.py; the merge now one [S, D] load a query head, default shape 64/3/1): its GPU tests, the micro-benchmark against flashinfer's graph-mode wrapper per
# launch shape, then decode graphs with HALFMOON_DECODE_ATTN unset / split_kv interleaved twice.
set -u
source scripts/gpu_call_env.sh
step "split_kv tests"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/unit/test_split_kv_decode.py \
  tests/unit/test_gpu_flashinfer.py -k "compiled_kernel or graph_decode_equals_eager" > "$OUT/tests.log" 2>&1
grep -E "^E |^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests.log"
step split_kv_micro
timeout 200 python3 -m bench.gpu split_kv_micro --out "$OUT/split_kv.json" 2>&1 | grep -E "^split_kv_micro B|Error" | cut -c1-170
for i in 1 2; do
  for be in "" split_kv; do
    step "decode ${be:-flashinfer} $i"
    HALFMOON_DECODE_ATTN=$be timeout 110 python3 -m bench.gpu decode --iters 30 --batches 1,8,32,64 \
      --contexts 1024,4096 --out "$OUT/d-${be:-fi}-$i.json" 2>&1 | grep -E '^ +[0-9]+ +[0-9]+ |Error' | cut -c1-84
  done
done
step done

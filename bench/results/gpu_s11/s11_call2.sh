#!/usr/bin/env bash
# Session 11, call 2 (GPU_NOTES.md): GPU tests after the graph-runner fix, decode with the fused RoPE +
# K/V store on/off interleaved, prefill_parts with the SM clock logged. Results under $OUT.
set -u
source scripts/gpu_call_env.sh
step tests
python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_rope_kv_store.py tests/unit/test_gpu_flashinfer.py \
  tests/unit/test_flashinfer_plan_fence.py 2>&1 | tee $OUT/call2_pytest.log | tail -6
for i in 1 2; do
  for m in on off; do
    step "decode $m $i"
    HALFMOON_FUSED_ROPE_STORE=$([ $m = on ] && echo 1 || echo 0) python3 -m bench.gpu decode --iters 30 \
      --batches 1,32,128 --contexts 1024,4096 --out $OUT/call2_decode_${m}_$i.json 2>&1 \
      | tee $OUT/call2_decode_${m}_$i.log | grep -v '^{' | tail -7
  done
done
step prefill_parts
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 > $OUT/call2_clocks.csv &
smi=$!
python3 -m bench.gpu prefill_parts --iters 20 --out $OUT/call2_parts.json 2>&1 | tee $OUT/call2_parts.log | grep -v '^{'
kill $smi
step done

#!/usr/bin/env bash
# Session 12, call 3 (GPU_NOTES.md): GPU tests on this stop's tree; prefill and prefill_parts (their
# shared prefill_row helper, first run); decode with flashinfer's split-KV chunk fixed at 4 or 16
# pages vs its own choice, interleaved twice.
set -u
source scripts/gpu_call_env.sh
step tests
python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_rope_kv_store.py tests/unit/test_gpu_flashinfer.py \
  tests/unit/test_flashinfer_plan_fence.py 2>&1 | tail -4
step "prefill prefill_parts"
python3 -m bench.gpu prefill prefill_parts --iters 20 --prefill-backends fa3 --out /tmp/p.json 2>&1 | grep -v '^{' \
  | grep -i -E "prefill|ms|error|Traceback" | tail -25 | cut -c1-120
for i in 1 2; do
  for sp in "" 4 16; do
    step "decode split_pages=${sp:-flashinfer} $i"
    HALFMOON_FLASHINFER_DECODE_SPLIT_PAGES=$sp python3 -m bench.gpu decode --iters 30 --batches 1,8,32,128 \
      --contexts 1024,4096 --out /tmp/d.json 2>&1 | grep -v '^{' | tail -8 | cut -c1-80
  done
done
step done

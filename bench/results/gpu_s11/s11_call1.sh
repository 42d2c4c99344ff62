#!/usr/bin/env bash
# Session 11, call 1 (GPU_NOTES.md): GPU tests, prefill_parts, decode + prefill, decode with the fused
# RoPE + K/V store off. Run from the repository root on the GPU machine; results under $OUT.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step tests
python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_rope_kv_store.py tests/unit/test_gpu_flashinfer.py \
  tests/unit/test_flashinfer_plan_fence.py 2>&1 | tee $OUT/call1_pytest.log | tail -15
(cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/flashinfer-so.tar.gz" -T -) 2>/dev/null
step prefill_parts
python3 -m bench.gpu prefill_parts --iters 20 --out $OUT/call1_parts.json 2>&1 | tee $OUT/call1_parts.log | grep -v '^{'
step "decode prefill (rope store on)"
python3 -m bench.gpu decode prefill --iters 20 --prefill-backends fa3 --out $OUT/call1_on.json 2>&1 \
  | tee $OUT/call1_on.log | grep -v '^{' | tail -30
step "decode (rope store off)"
HALFMOON_FUSED_ROPE_STORE=0 python3 -m bench.gpu decode --iters 20 --batches 1,32,128 --contexts 1024,4096 \
  --out $OUT/call1_off.json 2>&1 | tee $OUT/call1_off.log | grep -v '^{' | tail -12
step done
(cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/flashinfer-so.tar.gz" -T -) 2>/dev/null

#!/usr/bin/env bash
# Session 17, call 3 (GPU_NOTES.md): the shipped default (split_kv in bucket 1 only): GPU tests of
# the graph runner and the kernel, the engine archs' GPU cases, then decode B=1, 8 at ctx 1k.
set -u
source scripts/gpu_call_env.sh
step "gpu tests"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/unit/test_gpu_flashinfer.py \
  tests/unit/test_split_kv_decode.py tests/unit/test_engine_archs.py > "$OUT/tests.log" 2>&1
grep -E "^E |^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests.log"
step "decode default"
timeout 60 python3 -m bench.gpu decode --iters 30 --batches 1,8 --contexts 1024 --out "$OUT/d-default.json" 2>&1 \
  | grep -E '^ +[0-9]+ +[0-9]+ |Error' | cut -c1-84
step done

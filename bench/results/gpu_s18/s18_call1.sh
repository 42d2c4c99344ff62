#!/usr/bin/env bash
# Session 18, call 1 (GPU_NOTES.md): split-KV decode with a launch shape per batch size
# (engine.attention.split_kv_decode.default_config): its GPU tests, then split_kv_micro on 16 cases
# (B = 1, 2, 4, 8, 16, 32, 64, 128 x ctx 1k, 4k). Saves the compiled flashinfer ops (no cache came
# with this checkout).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step "split_kv tests"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/unit/test_split_kv_decode.py \
  tests/unit/test_gpu_flashinfer.py > "$OUT/tests.log" 2>&1
grep -E "^E |^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-300 | head -12; tail -1 "$OUT/tests.log"
(cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/flashinfer-so.tar.gz" -T -) 2>/dev/null
ls -la "$OUT/flashinfer-so.tar.gz"
step split_kv_micro
timeout 280 python3 -m bench.gpu split_kv_micro --out "$OUT/split_kv.json" 2>&1 | grep -E "^split_kv_micro B|Error" | cut -c1-170
step done

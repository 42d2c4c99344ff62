#!/usr/bin/env bash
# Session 15, call 4 (GPU_NOTES.md): the stop's final tree: the GPU tests by file (summary grepped
# out of the log, where cuDNN's leak report shares its line), then prefill 8k on this machine.
set -u
source scripts/gpu_call_env.sh
step "gpu tests"
gpu_tests > /dev/null; grep -E "^E |^FAILED|^ERROR" /tmp/gpu_tests.log | cut -c1-300 | head -14
grep -oE "[0-9]+ (passed|failed|skipped|errors?|deselected)[^=]*in [0-9.]+s" /tmp/gpu_tests.log | tail -1
cp /tmp/gpu_tests.log "$OUT/gpu_tests.log"
step prefill
timeout 300 python3 -m bench.gpu ceilings prefill --out "$OUT/prefill.json" 2>&1 | grep -E "^ceilings|^prefill|paged kernels" | cut -c1-120
step done

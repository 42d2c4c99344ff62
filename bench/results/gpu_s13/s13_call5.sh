#!/usr/bin/env bash
# Session 13, call 5 (GPU_NOTES.md): xqa_micro, a step's decode attention (32 layers in one CUDA
# graph) on flashinfer's graph-mode wrapper (split-KV + merge kernels) vs flashinfer's xqa (one
# kernel); xqa is JIT-compiled here and its .so comes back in $OUT.
set -u
source scripts/gpu_call_env.sh
step xqa_micro
timeout 420 python3 -m bench.gpu xqa_micro --out /tmp/x.json 2>&1 | grep -v '^{' | grep -E "xqa_micro|Error|error" | cut -c1-200 | head -20
(cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/xqa-so.tar.gz" -T -) 2>/dev/null
step done

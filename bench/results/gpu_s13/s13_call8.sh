#!/usr/bin/env bash
# Session 13, call 8 (GPU_NOTES.md): the GPU tests after the review (bucket-32 graph vs eager under
# cuBLASLt, Qwen's q/k/v bias on tinygemm, the device-parametrized test files).
set -u
source scripts/gpu_call_env.sh
step "GPU tests"
gpu_tests
step done

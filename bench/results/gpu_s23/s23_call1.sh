#!/usr/bin/env bash
# Session 23, call 1 (GPU_NOTES.md): decode PDL default | HALFMOON_DECODE_PDL_HOIST=1 interleaved
# twice (B = 1, 8, 32 at ctx 1k and 4k), split_kv_micro with the 44-shape wide grid between the runs
# (B=1 ctx 4k; B = 32, 64, 128 ctx 1k), then the GPU tests in the time left (they compile the flashinfer ops this
# checkout lacks; saved to $OUT for later calls). 7 files back.
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
decode_pair() {  # $1: run number
  for hoist in "" 1; do
    step "decode HOIST='$hoist' run $1"
    HALFMOON_DECODE_PDL_HOIST=$hoist timeout 120 python3 -m bench.gpu decode --iters 20 --batches 1,8,32 \
      --contexts 1024,4096 --eager-batches 0 --out "$OUT/d-hoist${hoist:-0}-$1.json" 2>&1 | keep_rows
  done
}
decode_pair 1
step "split_kv_micro wide"
timeout 170 python3 -m bench.gpu split_kv_micro --micro-grid wide --micro-cases 1x4096,32x1024,64x1024,128x1024 \
  --out "$OUT/skv-wide.json" 2>&1 | grep -E "^split_kv_micro|Error" | cut -c1-170
decode_pair 2
save_ops
left=$(( 565 - ($(date +%s) - t0) ))  # the tests take what is left of the 600 s call (~260 s when compiling)
step "gpu_tests (${left} s left)"
timeout $left bash -c "$(declare -f gpu_tests); gpu_tests"
save_ops
ls "$OUT"
step done

#!/usr/bin/env bash
# Session 22, call 1 (GPU_NOTES.md): decode with HALFMOON_DECODE_PDL unset / "1" interleaved twice
# (ctx 1k B = 1, 4, 8, 32, 64, 128; ctx 4k B = 1, 4, 8, 32, 64), the GPU tests between the two runs
# (they compile the flashinfer ops this checkout lacks; saved to $OUT for later calls), then
# graph_profile with PDL on (B = 1 and 32, ctx 1k).
set -u
source scripts/gpu_call_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import triton; print('triton', triton.__version__)"
decode_pair() {  # $1: run number
  for pdl in "" 1; do
    step "decode PDL='$pdl' run $1"
    HALFMOON_DECODE_PDL=$pdl timeout 150 python3 -m bench.gpu decode --iters 20 --batches 1,4,8,32,64,128 \
      --contexts 1024 --eager-batches 0 --out "$OUT/d1k-pdl${pdl:-0}-$1.json" 2>&1 | keep_rows
    HALFMOON_DECODE_PDL=$pdl timeout 120 python3 -m bench.gpu decode --iters 20 --batches 1,4,8,32,64 \
      --contexts 4096 --eager-batches 0 --out "$OUT/d4k-pdl${pdl:-0}-$1.json" 2>&1 | keep_rows
  done
}
decode_pair 1
save_ops
step gpu_tests
timeout 300 bash -c "$(declare -f gpu_tests); gpu_tests"
save_ops
decode_pair 2
step "graph_profile PDL=1"
HALFMOON_DECODE_PDL=1 timeout 60 python3 -m bench.gpu graph_profile --out "$OUT/gprof-pdl.json" 2>&1 \
  | grep -E "^graph_profile|^  +[0-9.]+ us|Error" | cut -c1-150 | head -30
step done

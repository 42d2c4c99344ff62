#!/usr/bin/env bash
# Session 14, call 2 (GPU_NOTES.md): decode graphs with the tuned GEMM off / cublaslt / cudnn,
# interleaved twice over B = 1, 8, 16, 32, 64, 128 and ctx 1k, 4k ("auto" needs the CuTe DSL, which
# is not carried: call 1). The first run of each backend tunes and writes its choices to a cache
# file; the second reads them (what a restart does).
set -u
source scripts/gpu_call_env.sh
step ceilings  # the floors divide by this GPU's copy bandwidth and GEMM rate (it may be an H100, not the H200)
python3 -m bench.gpu ceilings --out "$OUT/ceilings.json" 2>&1 | tail -1
read bw rate < <(python3 -c "import json; c = json.load(open('$OUT/ceilings.json'))['ceilings']; print(c['copy_bw_Bps'], c['gemm_flops'])")
for i in 1 2; do
  for be in off cublaslt cudnn; do
    step "decode $be $i"
    # two pools: B=128 at ctx 4k needs 64 GiB of KV, which an H100 lacks beside the 16 GB of weights
    for grid in "1,8,16,32,64,128 1024" "1,8,16,32,64 4096"; do
      set -- $grid
      HALFMOON_TUNED_GEMM=$be HALFMOON_TUNED_GEMM_CACHE=/tmp/tuned-$be.json timeout 80 python3 -m bench.gpu decode \
        --copy-bw $bw --gemm-rate $rate --iters 30 --batches $1 --contexts $2 --out "$OUT/decode-$be-$i-$2.json" 2>&1 \
        | grep -v '^{' | tail -7 | cut -c1-84
    done
  done
done
step done

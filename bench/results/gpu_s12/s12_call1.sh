#!/usr/bin/env bash
# Session 12, calls 1 and 2 (GPU_NOTES.md): GPU tests with the skinny decode GEMM on, its tile sweep against
# cuBLAS, then decode with it on / off interleaved (and with the sweep's best single tile).
# Ran at commit 457d1a4 (call 1, tensor-core kernel) and d869ce8 (call 2, CUDA-core kernel); both were removed after.
set -u
source scripts/gpu_call_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step tests
python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_skinny_gemm.py tests/unit/test_rope_kv_store.py \
  tests/unit/test_gpu_flashinfer.py tests/unit/test_flashinfer_plan_fence.py 2>&1 | tail -15
(cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/flashinfer-so.tar.gz" -T -) 2>/dev/null
step skinny_gemm
python3 -m bench.gpu skinny_gemm --out $OUT/sweep.json 2>&1 | grep "^skinny"
best=$(python3 -c "
import json; r = json.load(open('$OUT/sweep.json'))['skinny_gemm']
tot = {}
for row in r['rows']:
    if row['M'] == 1 and 'sweep' in row and row['gemm'] not in ('gate_up', 'down'):
        for p in row['sweep']:
            k = (p['bn'], p['bk'], p['num_warps'], p['num_stages']); tot.setdefault(k, []).append(p['us'])
k = min((k for k in tot if len(tot[k]) == 3), key=lambda k: sum(tot[k]))
print(','.join(map(str, k)))")
echo "best single tile at M=1 (qkv+o+down): $best"
for i in 1 2; do
  for mode in 1 0 $best; do
    step "decode skinny=$mode $i"
    HALFMOON_SKINNY_GEMM=$mode python3 -m bench.gpu decode --iters 30 --batches 1,8,32,128 --contexts 1024,4096 \
      --out /tmp/d.json 2>&1 | grep -v '^{' | tail -8 | cut -c1-80
  done
done
step done

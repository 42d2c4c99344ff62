#!/usr/bin/env bash
# Session 13, call 2 (GPU_NOTES.md): small_gemm with tinygemm (call 1's section crashed on its
# in-place return), the failing model-vs-transformers asserts with tinygemm, then decode with tinygemm
# on the projections where it beat cuBLAS alone at M = 1 ("best"), on o + down, and off, interleaved.
set -u
source scripts/gpu_call_env.sh
step small_gemm
python3 -m bench.gpu small_gemm --out /tmp/g.json 2>&1 | grep -E "small_gemm|Error" | cut -c1-100
best=$(python3 -c "
import json; rows = json.load(open('/tmp/g.json'))['small_gemm']['rows']
us = {(r['gemm'], r['lib']): r['us'] for r in rows if r['M'] == 1}
print(','.join(g for g in ('qkv', 'o', 'gate_up', 'down') if us[(g, 'tinygemm')] < us[(g, 'cublas')]))")
echo "tinygemm beats cuBLAS at M=1 on: ${best:-none}"
step "model test asserts"
HALFMOON_SMALL_M_GEMM=tinygemm python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_gpu_flashinfer.py \
  -k model_matches --tb=short 2>&1 | grep -E "^E |passed|failed" | cut -c1-400 | head -12
for i in 1 2; do
  for on in off o,down $best; do
    step "decode tinygemm on=$on $i"
    mode=$([ $on = off ] && echo cublas || echo tinygemm)
    HALFMOON_SMALL_M_GEMM=$mode HALFMOON_SMALL_M_GEMM_ON=$([ $on = off ] && echo o || echo $on) python3 -m bench.gpu \
      decode --iters 30 --batches 1,4,8 --contexts 1024,4096 --out /tmp/d.json 2>&1 | grep -v '^{' | tail -7 | cut -c1-84
  done
done
step done

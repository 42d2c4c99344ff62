#!/usr/bin/env bash
# Session 11, call 5 (GPU_NOTES.md): small-M GEMMs per BLAS library; decode graphs under each.
set -u
export PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0
site=/tmp/site; mkdir -p $site
python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | grep -v "already exists"
export PYTHONPATH=$site:$PWD
tmp=$(mktemp -d) && tar -xzf gpu-cache/flashinfer-so.tar.gz -C $tmp && mkdir -p $site/flashinfer/data/aot &&
for d in $tmp/flashinfer/*/*/cached_ops/*/; do cp -r "$d" $site/flashinfer/data/aot/; done
t0=$(date +%s)
step() { echo "=== $1 (t=$(( $(date +%s) - t0 ))s)"; }
step small_gemm
python3 -m bench.gpu small_gemm --out /tmp/sg.json 2>&1 | grep "^small_gemm"
for i in 1 2; do
  for lib in default cublaslt; do
    step "decode blas=$lib $i"
    HALFMOON_DECODE_GRAPH_BLAS=$([ $lib = default ] && echo "" || echo $lib) python3 -m bench.gpu decode --iters 30 \
      --batches 1,8,32,128 --contexts 1024,4096 --out /tmp/d_${lib}_$i.json 2>&1 | grep -v '^{' | tail -8 | cut -c1-80
  done
done
step done

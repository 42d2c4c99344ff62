#!/usr/bin/env bash
# Session 8, call 3: decode host time old vs new code, interleaved twice (is call 2's host_ms gap the fence?).
set -u
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_USE_CUDA_NORM=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; ROOT=$PWD; LOG=$OUT/all.log; site=/tmp/site
if [ ! -d $site/flashinfer/data/aot ]; then
python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | grep -v "already exists"
tmp=$(mktemp -d) && tar -xzf .gpuwork/cache/flashinfer-so.tar.gz -C $tmp && mkdir -p $site/flashinfer/data/aot &&
  for d in $tmp/flashinfer/*/*/cached_ops/*/; do cp -r "$d" $site/flashinfer/data/aot/; done
fi
export PYTHONPATH=$site
for rep in 1 2; do for code in old new; do
  dir=$ROOT; [ $code = new ] && dir=$ROOT/.gpuwork/tree
  echo "=== $code rep $rep" | tee -a $LOG
  (cd $dir && timeout 100 python3 -m bench.gpu decode --batches 1,128 --contexts 1024,4096 --iters 50 --out $OUT/decode_${code}_$rep.json 2>&1 | grep -v "^{" | tail -5 | tee -a $LOG)
done; done

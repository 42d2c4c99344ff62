#!/usr/bin/env bash
# Session 8, call 4: the final tree's GPU tests (compiled ops restored, no JIT).
set -u
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_USE_CUDA_NORM=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; ROOT=$PWD; site=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | grep -v "already exists"
tmp=$(mktemp -d) && tar -xzf .gpuwork/cache/flashinfer-so.tar.gz -C $tmp && mkdir -p $site/flashinfer/data/aot &&
  for d in $tmp/flashinfer/*/*/cached_ops/*/; do cp -r "$d" $site/flashinfer/data/aot/; done
export PYTHONPATH=$site
cd $ROOT/.gpuwork/tree && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/unit/test_flashinfer_plan_fence.py tests/unit/test_gpu_flashinfer.py 2>&1 | tail -12 | tee $OUT/pytest.log

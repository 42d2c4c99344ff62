#!/usr/bin/env bash
# Session 8, call 2: compiled ops restored (no JIT); GPU tests with fa3 the default; the plan-race
# repro with a warm-up; prefill (default fa3 + fa2 again); decode table old code vs new code.
set -u
export PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_USE_CUDA_NORM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; ROOT=$PWD; LOG=$OUT/all.log; site=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | grep -v "already exists"
tmp=$(mktemp -d) && tar -xzf .gpuwork/cache/flashinfer-so.tar.gz -C $tmp && mkdir -p $site/flashinfer/data/aot &&
  for d in $tmp/flashinfer/*/*/cached_ops/*/; do cp -r "$d" $site/flashinfer/data/aot/; done
export PYTHONPATH=$site
t0=$(date +%s); st() { echo "=== $* (t=$(( $(date +%s) - t0 ))s)" | tee -a $LOG; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader | tee -a $LOG
cd $ROOT/.gpuwork/tree
st pytest new
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_flashinfer_plan_fence.py tests/unit/test_gpu_flashinfer.py 2>&1 | tail -6 | tee -a $LOG
st race
for a in "fa3 sync up" "fa3 nosync up" "fa3 nosync down" "fa3 fence up" "fa3 fence down" "fa2 nosync down"; do
  set -- $a; timeout 45 python3 -m bench.gpu_plan_race --backend $1 --how $2 --order $3 2>&1 | tail -1 | tee -a $LOG
done
st prefill new default
timeout 120 python3 -m bench.gpu prefill --prefill-backends fa2 --out $OUT/prefill.json 2>&1 | grep -E "^prefill|paged kernels" | tee -a $LOG
st decode old
(cd $ROOT && timeout 150 python3 -m bench.gpu decode --out $OUT/decode_old.json 2>&1 | grep -v "^{" | tail -11 | tee -a $LOG)
st decode new
timeout 150 python3 -m bench.gpu decode --out $OUT/decode_new.json 2>&1 | grep -v "^{" | tail -11 | tee -a $LOG
st done

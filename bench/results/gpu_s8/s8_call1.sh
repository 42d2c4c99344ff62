#!/usr/bin/env bash
# Session 8, call 1: flashinfer JIT warm-up, the plan-race repro (standalone), GPU tests on the new and
# the old backend, prefill fa2 vs fa3 (new code), the run-4 bench on the old code. Run from the repo root.
set -u
export PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_USE_CUDA_NORM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; ROOT=$PWD; LOG=$OUT/all.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists"
export PYTHONPATH=/tmp/site
t0=$(date +%s); st() { echo "=== $* (t=$(( $(date +%s) - t0 ))s)" | tee -a $LOG; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader | tee -a $LOG
cd $ROOT/.gpuwork/tree
st warm; timeout 300 python3 -m bench.gpu_warm 2>&1 | tail -12 | tee -a $LOG
st race
for a in "fa3 sync up" "fa3 nosync up" "fa3 nosync down" "fa3 fence up" "fa3 fence down" "fa2 nosync down"; do
  set -- $a; timeout 60 python3 -m bench.gpu_plan_race --backend $1 --how $2 --order $3 2>&1 | tail -2 | tee -a $LOG
done
CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 -m bench.gpu_plan_race --backend fa3 --how nosync --order up 2>&1 | sed 's/^/LAUNCH_BLOCKING=1 /' | tail -2 | tee -a $LOG
st pytest new
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_flashinfer_plan_fence.py tests/unit/test_gpu_flashinfer.py 2>&1 | tail -15 | tee -a $LOG
st pytest old backend, new test
cp tests/unit/test_flashinfer_plan_fence.py $ROOT/tests/unit/
(cd $ROOT && timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_flashinfer_plan_fence.py 2>&1 | grep -E "assert|passed|failed|Error" | tail -8 | tee -a $LOG)
st prefill new fa2,fa3
timeout 150 python3 -m bench.gpu prefill --prefill-backends fa2,fa3 --out $OUT/prefill.json 2>&1 | grep -v "^{" | tail -25 | tee -a $LOG
st old code run-4 bench fa3
(cd $ROOT && HALFMOON_FLASHINFER_PREFILL=fa3 timeout 100 python3 -m bench.gpu prefill --out $OUT/old_fa3.json 2>&1 | grep -E "prefill extend_mode|Error|error" | head -6 | tee -a $LOG)
st done
(cd ~/.cache && find flashinfer -name '*.so' | tar -czf $OUT/flashinfer-so.tar.gz -T -) ; ls -la $OUT

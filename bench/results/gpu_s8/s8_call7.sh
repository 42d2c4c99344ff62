#!/usr/bin/env bash
# Session 8, call 7 (lead): main after every merge of this stop, from the repository root.
# Carried as in call 5 (s8_call5.sh).
set -u
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_USE_CUDA_NORM=1 MAX_JOBS=16
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; ROOT=$PWD; W=$ROOT/.gpuwork; site=/tmp/site; LOG=$OUT/all.log
t0=$(date +%s); st() { echo "=== $* (t=$(( $(date +%s) - t0 ))s)" | tee -a $LOG; }
python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl $W/s28/svc/*.whl 2>&1 | grep -v "already exists"
tar -xzf $W/s28/libucx-slim.tgz -C $site
tmp=$(mktemp -d) && tar -xzf $W/cache/flashinfer-so.tar.gz -C $tmp && mkdir -p $site/flashinfer/data/aot &&
  for d in $tmp/flashinfer/*/*/cached_ops/*/; do cp -r "$d" $site/flashinfer/data/aot/; done
export PYTHONPATH=$site:$ROOT PATH=$site/bin:$PATH
cd $ROOT
gv=$(python3 -c 'import grpc; print(grpc.__version__)')
sed -i "s/^GRPC_GENERATED_VERSION = .*/GRPC_GENERATED_VERSION = '$gv'/" protos/*_pb2_grpc.py
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee -a $LOG
python3 -c "import libucx, flashinfer, fastapi, openai, xgrammar; print('imports ok, grpc $gv')" 2>&1 | tail -2 | tee -a $LOG
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -rA"
rem=$(( 330 - ($(date +%s) - t0) )); st "e2e services (limit ${rem}s)"
HALFMOON_GPU_MODEL_DIR=$W/s28/model-h128 timeout $rem $PT tests/e2e/test_gpu_services.py > $OUT/e2e.log 2>&1
echo "rc=$?" >> $OUT/e2e.log; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|rc=" $OUT/e2e.log | tee -a $LOG
rem=$(( 330 - ($(date +%s) - t0) )); st "GPU unit + TP write path cuda cases (limit ${rem}s)"
timeout $rem $PT tests/unit/test_gpu_flashinfer.py tests/unit/test_gpu_pd.py tests/unit/test_flashinfer_plan_fence.py tests/unit/test_head_blocks.py tests/unit/test_head_checksums.py tests/unit/test_staged_writes.py > $OUT/unit.log 2>&1
echo "rc=$?" >> $OUT/unit.log; grep -E "passed|failed|rc=" $OUT/unit.log | tail -3 | tee -a $LOG
git checkout -q -- protos 2>/dev/null
st done
[ -d ~/.cache/flashinfer ] && (cd ~/.cache && find flashinfer -name '*.so' | tar -czf $OUT/flashinfer-so-new.tar.gz -T -) && ls -la $OUT/flashinfer-so-new.tar.gz | tee -a $LOG

#!/usr/bin/env bash
# Session 8, call 6 (s28-gpuval): after the pool_pages fix (pd_common/rank_accounting.py), the services end to end again.
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
export PYTHONPATH=$site:$W/tree PATH=$site/bin:$PATH
cd $W/tree
gv=$(python3 -c 'import grpc; print(grpc.__version__)')
sed -i "s/^GRPC_GENERATED_VERSION = .*/GRPC_GENERATED_VERSION = '$gv'/" protos/*_pb2_grpc.py
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee -a $LOG
python3 -c "import libucx, flashinfer, fastapi, openai, xgrammar; print('imports ok, grpc $gv')" 2>&1 | tail -2 | tee -a $LOG
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -rA"
rem=$(( 165 - ($(date +%s) - t0) )); st "e2e services (limit ${rem}s)"
HALFMOON_GPU_MODEL_DIR=$W/s28/model-h128 timeout $rem $PT tests/e2e/test_gpu_services.py > $OUT/e2e.log 2>&1
echo "rc=$?" >> $OUT/e2e.log; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|rc=" $OUT/e2e.log | tee -a $LOG
st done
[ -d ~/.cache/flashinfer ] && (cd ~/.cache && find flashinfer -name '*.so' | tar -czf $OUT/flashinfer-so-new.tar.gz -T -) && ls -la $OUT/flashinfer-so-new.tar.gz | tee -a $LOG

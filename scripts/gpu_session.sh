#!/usr/bin/env bash
# One device call: install the carried wheels, restore compiled flashinfer ops, run the given steps,
# save the (new) compiled ops and logs under $OUT.   Run from the repo root on the GPU machine:
#   scripts/gpu_session.sh warm test bench:"ceilings correctness decode prefill"
# Steps: warm (compile flashinfer modules in parallel), test (pytest -m gpu tests/unit/test_gpu_*.py),
#        bench:"<sections>" (python -m bench.gpu <sections> --out $OUT/gpu.json), any other word runs as is.
set -u
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_USE_CUDA_NORM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
site=/tmp/site; mkdir -p $site
for d in wheels-fi wheels-ucx wheels-svc wheels-tools; do
  if ls $d/*.whl >/dev/null 2>&1; then python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target $site $d/*.whl 2>&1 | grep -v "already exists"; fi
done
export PYTHONPATH=$site:$PWD PATH=$site/bin:$PATH
for m in gpu-cache/*.txz; do [ -f "$m" ] && tar -xJf "$m" -C gpu-cache; done  # model dirs (config + tokenizer), xz'd to fit the carry
if [ -f gpu-cache/libucx-slim.tgz ]; then tar -xzf gpu-cache/libucx-slim.tgz -C $site; fi  # slim libucx-cu13 (libs only)
# Compiled flashinfer ops: flashinfer 0.6.18 rebuilds a JIT-cache .so unless ninja's .o files are
# there too, but it loads <package>/data/aot/<module>/<module>.so without building: restore them there.
if [ -f gpu-cache/flashinfer-so.tar.gz ]; then
  tmp=$(mktemp -d) && tar -xzf gpu-cache/flashinfer-so.tar.gz -C $tmp && mkdir -p $site/flashinfer/data/aot &&
  for d in $tmp/flashinfer/*/*/cached_ops/*/; do cp -r "$d" $site/flashinfer/data/aot/; done
  ls $site/flashinfer/data/aot
fi
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
# save_cache: the .so files this call compiled (merge $OUT/flashinfer-so.tar.gz into gpu-cache/ only when
# it holds modules the cache lacks; a call that compiled nothing returns an empty tar).
save_cache() {
  if [ -d ~/.cache/flashinfer ]; then
    (cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/flashinfer-so.tar.gz" -T -) && ls -la "$OUT/flashinfer-so.tar.gz"
  fi
}
t0=$(date +%s)
for step in "$@"; do
  echo "=== $step  (t=$(( $(date +%s) - t0 ))s)"
  case "$step" in
    warm) python3 -m bench.gpu_warm 2>&1 | tee -a "$OUT/warm.log" | tail -20; save_cache ;;
    test) python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/unit/test_gpu_flashinfer.py tests/unit/test_gpu_pd.py 2>&1 | tee "$OUT/pytest.log" | tail -25 ;;
    bench:*) python3 -m bench.gpu ${step#bench:} --out "$OUT/gpu.json" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^{" ;;
    *) bash -c "$step" 2>&1 | tee -a "$OUT/other.log" | tail -40 ;;
  esac
done
echo "=== done (t=$(( $(date +%s) - t0 ))s)"
save_cache

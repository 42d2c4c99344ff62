# Sourced (from the repository root, on the GPU machine) by the per-call scripts under
# bench/results/gpu_s*/: installs the carried wheels (.whl/) into /tmp/site, restores compiled
# flashinfer ops from gpu-cache/*-so.tar.gz as AOT modules (no JIT; flashinfer 0.6.18 rebuilds a
# JIT-cache .so unless ninja's .o files are there too), and defines `step NAME`, a section header
# with the seconds since this file was sourced, and `gpu_tests`, the GPU unit tests by file (the GPU
# machine lacks the services' packages, so `pytest -m gpu tests/unit` as a whole stops at collection)
# printing only the summary and failed asserts (the whole log goes to $OUT/gpu_tests.log),
# `keep_rows`, a filter keeping bench.gpu decode's table rows and errors, and `save_ops`, which brings
# the flashinfer ops this call compiled back as $OUT/flashinfer-so.tar.gz (for gpu-cache/).
export PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0
site=/tmp/site; mkdir -p $site
python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | grep -v "already exists"
export PYTHONPATH=$site:$PWD
for tgz in gpu-cache/*-so.tar.gz; do  # flashinfer-so, tinygemm-so, ...: .so trees from earlier calls
  [ -f "$tgz" ] || continue
  tmp=$(mktemp -d) && tar -xzf "$tgz" -C $tmp && mkdir -p $site/flashinfer/data/aot &&
  for d in $tmp/flashinfer/*/*/cached_ops/*/; do cp -r "$d" $site/flashinfer/data/aot/; done
done
t0=$(date +%s)
step() { echo "=== $1 (t=$(( $(date +%s) - t0 ))s)"; }
gpu_tests() {  # the test files with GPU cases that run there (test_head_blocks, test_head_checksums and
  # test_staged_writes have CUDA cases too, but need the UCX binding, which the GPU machine lacks)
  python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/unit/test_rope_kv_store.py \
    tests/unit/test_small_m_gemm.py tests/unit/test_tuned_gemm.py tests/unit/test_gpu_flashinfer.py tests/unit/test_flashinfer_plan_fence.py \
    tests/unit/test_engine_archs.py tests/unit/test_gpu_pd.py tests/unit/test_split_kv_decode.py > /tmp/gpu_tests.log 2>&1
  local rc=$?
  [ -n "${OUT:-}" ] && cp /tmp/gpu_tests.log "$OUT/gpu_tests.log"
  grep -E "^E |^FAILED|^ERROR" /tmp/gpu_tests.log | cut -c1-300 | head -14
  grep -E "[0-9]+ (passed|failed)" /tmp/gpu_tests.log | tail -1  # the summary (native-extension leak notes follow it)
  return $rc
}
save_ops() { (cd ~/.cache && find flashinfer -name '*.so' | tar -czf "$OUT/flashinfer-so.tar.gz" -T -) 2>/dev/null; }
keep_rows() { grep -E '^ +[0-9]+ +[0-9]+ |Error' | cut -c1-84; }

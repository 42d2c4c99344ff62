# Sourced (from the repository root, on the GPU machine) by the per-call scripts under
# bench/results/gpu_s*/: installs the carried wheels (.whl/) into /tmp/site, restores compiled
# flashinfer ops from gpu-cache/flashinfer-so.tar.gz as AOT modules (no JIT; flashinfer 0.6.18
# rebuilds a JIT-cache .so unless ninja's .o files are there too), and defines `step NAME`, a
# section header with the seconds since this file was sourced.
export PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0
site=/tmp/site; mkdir -p $site
python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl 2>&1 | grep -v "already exists"
export PYTHONPATH=$site:$PWD
if [ -f gpu-cache/flashinfer-so.tar.gz ]; then
  tmp=$(mktemp -d) && tar -xzf gpu-cache/flashinfer-so.tar.gz -C $tmp && mkdir -p $site/flashinfer/data/aot &&
  for d in $tmp/flashinfer/*/*/cached_ops/*/; do cp -r "$d" $site/flashinfer/data/aot/; done
fi
t0=$(date +%s)
step() { echo "=== $1 (t=$(( $(date +%s) - t0 ))s)"; }

#!/usr/bin/env bash
# A model directory for `--load-format dummy` on a machine without the model cache (the GPU machine):
# the pulled model's config.json and tokenizer files, no weights. Workers build random weights of that
# shape (deterministic by seed); the router and decode workers read the tokenizer from it.
#   scripts/make_gpu_model_dir.sh [DEST] [MODEL]
#   DEST  default gpu-cache/model-smollm2-dummy (an ignored folder the GPU runs carry)
#   MODEL default smollm2-135m-instruct (a name in the local model cache, or an HF directory)
# Then, on the GPU machine: HALFMOON_GPU_MODEL_DIR=$PWD/gpu-cache/model-smollm2-dummy ...
set -euo pipefail
dest=${1:-gpu-cache/model-smollm2-dummy}
model=${2:-smollm2-135m-instruct}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
[ -x "$py" ] || py=python3
src=$(cd "$here" && "$py" -c 'import sys; from engine.model_store import resolve_model; print(resolve_model(sys.argv[1]))' "$model")
mkdir -p "$dest"
for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json \
         special_tokens_map.json; do
  if [ -f "$src/$f" ]; then cp "$src/$f" "$dest/"; fi
done
for f in config.json tokenizer.json; do
  [ -f "$dest/$f" ] || { echo "make_gpu_model_dir: $src has no $f" >&2; exit 1; }
done
echo "$dest: $(ls "$dest" | tr '\n' ' ')(from $src)"

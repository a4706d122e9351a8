#!/usr/bin/env bash
# What a session with a lent GPU runs (one machine, under ten minutes): bench/sdpa_shapes.py (bf16 step time
# with cuDNN's attention backend on and off, plain torch), bench/gpu_profiles.py's frozen-weight
# rows (base LoRA and SFT, frozen float32 / int8 / bfloat16 / int8 with bf16; eight at once on the GPU:
# their peaks are their own, their step times shared) and its profile rows (each profile as it chooses
# against 2 x 16, tiny / small / base), then the GPU-marked tests. A trainer run there costs 40-110 s: narrow
# the profile rows with PRESETS= and PROFILES= to what is still unmeasured (docs/benchmarks.md). Python wheels the machine lacks
# (a newer transformers, datasets, fire, optimum-quanto) go in .whl (see /work/.library/device/README.md).
# Writes its log and gpu_profiles.json under ${OUT:-/tmp/gpu_check}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/log"; }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -3
  export PYTHONPATH=/tmp/site
fi
log "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/log"
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" \
  2>&1 | tail -1 | tee -a "$OUT/log"

log "bench/sdpa_shapes.py: bf16 step time with cuDNN's attention on and off"
timeout "${SDPA_S:-120}" python3 -m bench.sdpa_shapes 2>&1 | tee -a "$OUT/log"

log "bench/gpu_profiles.py: frozen weights"
timeout "${FROZEN_S:-180}" python3 -m bench.gpu_profiles --parts=frozen --steps=6 --jobs="${FROZEN_JOBS:-8}" --json="$OUT/gpu_frozen.json" 2>&1 \
  | tee -a "$OUT/log"

log "bench/gpu_profiles.py: profiles, auto against 2 x 16"
timeout "${PROFILES_S:-330}" python3 -m bench.gpu_profiles --presets="${PRESETS:-tiny,small,base}" \
  --profiles="${PROFILES:-gpu8g,gpu24g}" --steps=6 --parts=profiles --json="$OUT/gpu_profiles.json" 2>&1 | tee -a "$OUT/log"

log "GPU-marked tests"
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests 2>&1 | tail -5 | tee -a "$OUT/log"

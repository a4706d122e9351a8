#!/usr/bin/env bash
# The checks a session with a lent GPU runs (one machine, a few minutes): the GPU-marked tests, the default
# job, SFT with LoRA and 8-bit AdamW on the GPU, then bench/gpu_profiles.py and the encoder-cache speed bench.
# Writes its log (and gpu_profiles.json) under ${OUT:-/tmp/gpu_check}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/log"; }
runs=$(mktemp -d)

log "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/log"
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" \
  2>&1 | tee -a "$OUT/log"

log "GPU-marked tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests 2>&1 | tail -30 | tee -a "$OUT/log"

log "default job on the GPU: pretrain 30 steps, SFT 30 steps with LoRA and adamw8bit, generate"
timeout 180 python3 train_low_mem.py train --max_steps=30 --gradient_accumulation_steps=4 --eval_steps=30 \
  --mixed_precision=bf16 --output_dir="$runs/pre" 2>&1 | grep -E "step 30/|eval|peak|error" | tee -a "$OUT/log"
timeout 180 python3 train_low_mem.py train --is_finetune=True --init_from="$runs/pre/final" --max_steps=30 \
  --gradient_accumulation_steps=4 --eval_steps=30 --mixed_precision=bf16 --lora_r=8 --optimizer=adamw8bit \
  --learn_rate=1e-3 --output_dir="$runs/sft" 2>&1 | grep -E "step 30/|eval|peak|error" | tee -a "$OUT/log"
timeout 120 python3 train_low_mem.py generate --init_from="$runs/sft/final" --prompt="What makes you mad" 2>&1 \
  | tail -3 | tee -a "$OUT/log"

log "bench/gpu_profiles.py"
timeout 300 python3 bench/gpu_profiles.py --profiles=gpu8g,gpu16g,gpu24g --steps=8 --json="$OUT/gpu_profiles.json" \
  2>&1 | tee -a "$OUT/log"

log "bench/encoder_cache_speed.py on the GPU"
timeout 120 python3 bench/encoder_cache_speed.py --device=cuda --mixed_precision=bf16 2>&1 | tail -12 | tee -a "$OUT/log"
